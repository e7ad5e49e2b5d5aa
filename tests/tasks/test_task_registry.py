"""The `task` config section: defaults, building each task, and errors that name the key."""
import ml_collections
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.tasks import (CountdownTask, SyntheticStringTask, get_task, task_config,
                                  validate_task_config)


def test_default_is_reverse_with_the_documented_length_tail():
    task = get_task(task_config())
    assert isinstance(task, SyntheticStringTask) and task.name == "reverse"
    assert (task.min_length, task.max_length) == (1, 96)
    assert task.max_completion_tokens == 97


def test_name_switch_works_on_any_config_and_overrides_reach_the_task():
    cfg = task_config()
    cfg.name = "countdown"  # as --config.task.name=countdown would
    cfg.num_numbers = 3
    task = get_task(cfg)
    assert isinstance(task, CountdownTask) and task.num_numbers == 3


def test_custom_prefix_names_the_full_key():
    cfg = ml_collections.ConfigDict({"env": {"task": task_config(median_length=0.5)}})
    with pytest.raises(ConfigError, match=r"^env\.task\.median_length: must be >= 1"):
        get_task(cfg.env.task, prefix="env.task")


@pytest.mark.parametrize("overrides,key", [
    ({"name": "reversal"}, "task.name"),
    ({"median_length": 100.0}, "task.median_length"),
    ({"p99_length": 5.0}, "task.p99_length"),
    ({"min_length": 0}, "task.min_length"),
    ({"max_length": 0}, "task.max_length"),
    ({"partial_credit": "suffix"}, "task.partial_credit"),
    ({"truncated_reward": 2.0}, "task.truncated_reward"),
    ({"name": "countdown", "num_numbers": 1}, "task.num_numbers"),
    ({"name": "countdown", "max_target": 0}, "task.max_target"),
    ({"name": "countdown", "truncated_reward": float("nan")}, "task.truncated_reward"),
    ({"name": "gsm8k"}, "task.path"),
])
def test_invalid_values_name_the_key(overrides, key):
    cfg = task_config()
    cfg.update(overrides)
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: "):
        validate_task_config(cfg)


def test_unknown_and_missing_keys_are_errors():
    cfg = task_config().to_dict()
    cfg["medain_length"] = 20
    with pytest.raises(ConfigError, match=r"^task\.medain_length: unknown key"):
        get_task(cfg)
    with pytest.raises(ConfigError, match=r"^task\.medain_length: unknown key"):
        task_config(medain_length=20)
    cfg = task_config().to_dict()
    del cfg["p99_length"]
    with pytest.raises(ConfigError, match=r"^task\.p99_length: is missing"):
        get_task(cfg)


def test_use_all_numbers_must_be_a_bool():
    cfg = task_config("countdown").to_dict()
    cfg["use_all_numbers"] = "yes"
    with pytest.raises(ConfigError, match=r"^task\.use_all_numbers: must be a bool"):
        get_task(cfg)


def test_task_defaults_that_collide_are_an_error_naming_both_owners():
    from pipelinerl_jax.tasks import merge_defaults
    assert merge_defaults({"a": {"x": 1, "y": 2}, "b": {"x": 1, "z": 3}}) == {"x": 1, "y": 2,
                                                                            "z": 3}
    with pytest.raises(ValueError, match=r"'eval_size' collides: a sets 64, b sets 128"):
        merge_defaults({"a": {"eval_size": 64}, "b": {"eval_size": 128}})
