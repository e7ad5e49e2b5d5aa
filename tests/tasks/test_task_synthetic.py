"""Synthetic string tasks: the long-tailed length distribution and the reward rules."""
import itertools

import numpy as np
import pytest

from pipelinerl_jax.tasks import Problem, SyntheticStringTask


def lengths(task, n=20_000, seed=0):
    return np.array([p.meta["length"] for p in itertools.islice(task.problems(seed), n)])


@pytest.mark.parametrize("median,p99,cap", [(12, 69, 96), (30, 60, 64)])
def test_length_quantiles_match_the_config_and_cap_holds(median, p99, cap):
    task = SyntheticStringTask("reverse", median, p99, 1, cap)
    got = lengths(task)
    assert abs(np.median(got) - median) <= 1
    assert abs(np.percentile(got, 99) - p99) <= 0.06 * p99
    assert got.min() >= 1 and got.max() <= cap
    problems = list(itertools.islice(task.problems(1), 200))
    assert all(len(p.answer) == p.meta["length"] == len(p.prompt) - 1 for p in problems)
    assert task.max_completion_tokens == cap + 1 and task.max_prompt_chars == cap + 1


def test_a_low_cap_clips_the_tail_onto_the_cap():
    got = lengths(SyntheticStringTask("reverse", 12, 69, 1, 40), n=5000)
    assert got.max() == 40 and 0.02 < np.mean(got == 40) < 0.15  # P(L > 40) ~ 5.5%


def test_equal_median_and_p99_give_a_fixed_length():
    assert set(lengths(SyntheticStringTask("copy", 7, 7, 1, 10), n=500)) == {7}


@pytest.mark.parametrize("variant,target", [("reverse", "dcbba"), ("copy", "abbcd"),
                                            ("sort", "abbcd")])
def test_variants_and_exact_match(variant, target):
    task = SyntheticStringTask(variant)
    problem = Problem("p", "abbcd=" if variant != "sort" else "dbcba=", target)
    assert task.reward(problem, target).correct
    assert task.reward(problem, f" {target}\n").reward == 1.0  # surrounding whitespace ignored
    assert task.reward(problem, target[:-1]).reward == 0.0
    assert task.reward(problem, target + "a").reward == 0.0
    assert task.reward(problem, "").reward == 0.0


def test_prefix_partial_credit_penalises_short_long_and_wrong():
    task = SyntheticStringTask("reverse", partial_credit="prefix")
    problem = Problem("p", "dcba=", "abcd")
    assert task.reward(problem, "abxx").reward == pytest.approx(0.5)
    assert task.reward(problem, "ab").reward == pytest.approx(0.5)
    long = task.reward(problem, "abcdzz")
    assert long.reward == pytest.approx(4 / 6) and not long.correct
    assert task.reward(problem, "").reward == 0.0
    exact = task.reward(problem, "abcd")
    assert exact.reward == 1.0 and exact.correct
    assert exact.info == {"finish_reason": "stop", "target_length": 4, "output_length": 4,
                          "prefix_match": 4}
    truncated = task.reward(problem, "abcd", finish_reason="length")
    assert truncated.reward == 0.0 and not truncated.correct


def test_truncated_reward_can_penalise_runaway_samples():
    task = SyntheticStringTask("reverse", truncated_reward=-0.5)
    problem = Problem("p", "ab=", "ba")
    assert task.reward(problem, "bababababa", "length").reward == -0.5
    assert task.reward_range == (-0.5, 1.0)


def test_bad_constructor_arguments_are_named():
    with pytest.raises(ValueError, match="variant"):
        SyntheticStringTask("shuffle")
    with pytest.raises(ValueError, match="p99_length"):
        SyntheticStringTask("reverse", median_length=20, p99_length=10)
    with pytest.raises(ValueError, match="partial_credit"):
        SyntheticStringTask("reverse", partial_credit="suffix")
