"""Group advantage estimators against hand-computed values, and their options."""
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.losses import (advantage_config, advantages_from_config, baseline_advantages,
                                   compute_advantages, validate_advantage_config)


def test_estimators_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, population std 0.5
    np.testing.assert_allclose(baseline_advantages(rewards, "grpo"),
                               np.array([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-6))
    np.testing.assert_allclose(baseline_advantages(rewards, "dr_grpo"), [0.5, -0.5, -0.5, 0.5])
    # R_i minus the mean of the other three
    np.testing.assert_allclose(baseline_advantages([3.0, 0.0, 0.0, 1.0], "rloo"),
                               [3 - 1 / 3, 0 - 4 / 3, 0 - 4 / 3, 1 - 1])
    np.testing.assert_allclose(baseline_advantages([2.0, 5.0, 11.0], "grpo"),
                               (np.array([2, 5, 11]) - 6) / (np.sqrt(14) + 1e-6))
    assert baseline_advantages([4.0], "rloo") == 0.0


def test_group_result_fields():
    out = compute_advantages(np.array([1.0, 0.0]), "dr_grpo")
    assert out.keep and out.sample_mask.all() and out.advantages.dtype == np.float32
    np.testing.assert_allclose(out.advantages, [0.5, -0.5])
    np.testing.assert_allclose(out.rewards, [1.0, 0.0])


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0], [0.3]])
def test_zero_variance_groups_are_flagged_for_skipping(rewards):
    dropped = compute_advantages(rewards, "grpo", drop_zero_variance=True)
    assert not dropped.keep and np.all(dropped.advantages == 0)
    kept = compute_advantages(rewards, "grpo")
    assert kept.keep and np.all(kept.advantages == 0)
    assert compute_advantages([1.0, 0.0, 1.0], drop_zero_variance=True).keep


def test_overlong_penalty_is_dapo_soft_punishment():
    # L_max = 10, L_cache = 4: no penalty up to 6, linear to -1 at 10, -1 beyond.
    lengths = np.array([5, 6, 8, 10, 12])
    out = compute_advantages(np.ones(5), "dr_grpo", overlong="penalty", lengths=lengths,
                             max_length=10, overlong_buffer=4, overlong_penalty=0.5)
    np.testing.assert_allclose(out.rewards, 1 + 0.5 * np.array([0, 0, -0.5, -1, -1]))
    np.testing.assert_allclose(out.advantages, out.rewards - out.rewards.mean(), rtol=1e-6)
    assert out.sample_mask.all()


def test_overlong_filter_masks_truncated_samples_and_leaves_them_out_of_the_baseline():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    out = compute_advantages(rewards, "dr_grpo", overlong="filter",
                             truncated=np.array([False, True, False, False]))
    np.testing.assert_array_equal(out.sample_mask, [True, False, True, True])
    np.testing.assert_allclose(out.advantages, [1 / 3, 0.0, -2 / 3, 1 / 3], rtol=1e-6)
    by_length = compute_advantages(rewards, "dr_grpo", overlong="filter",
                                   lengths=[3, 10, 4, 9], max_length=10)
    np.testing.assert_array_equal(by_length.advantages, out.advantages)
    nothing_left = compute_advantages(rewards, "grpo", overlong="filter", truncated=[1, 1, 1, 1])
    assert not nothing_left.keep and np.all(nothing_left.advantages == 0)


@pytest.mark.parametrize("kwargs,key", [
    ({"estimator": "ppo"}, "advantage.estimator"),
    ({"overlong": "clip"}, "advantage.overlong"),
    ({"overlong": "penalty", "lengths": [1, 2], "max_length": 8}, "advantage.overlong_buffer"),
    ({"overlong": "penalty", "lengths": [1, 2], "max_length": 8, "overlong_buffer": 9},
     "advantage.overlong_buffer"),
    ({"overlong": "penalty", "overlong_buffer": 2}, "advantage.overlong"),
    ({"overlong": "filter"}, "advantage.overlong"),
    ({"overlong_penalty": -1.0}, "advantage.overlong_penalty"),
])
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as e:
        compute_advantages(np.array([1.0, 0.0]), **kwargs)
    assert e.value.key == key


def test_bad_arrays_name_the_argument():
    with pytest.raises(ValueError, match="^rewards"):
        compute_advantages(np.array([]))
    with pytest.raises(ValueError, match="^rewards"):
        compute_advantages(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="^lengths"):
        compute_advantages([1.0, 0.0], overlong="filter", lengths=[1, 2, 3], max_length=4)


def test_config_section():
    cfg = advantage_config()
    cfg.estimator, cfg.overlong, cfg.overlong_buffer = "rloo", "penalty", 2
    out = advantages_from_config(cfg, [1.0, 1.0, 0.0], lengths=[1, 4, 1], max_length=4)
    np.testing.assert_allclose(out.rewards, [1.0, 0.0, 0.0])
    np.testing.assert_allclose(out.advantages, [1.0, -0.5, -0.5])
    with pytest.raises(ConfigError, match="^advantage.drop_zero_variance"):
        validate_advantage_config({"drop_zero_variance": "yes"})
    with pytest.raises(ConfigError, match="^advantage.bogus"):
        validate_advantage_config({"bogus": 1})
