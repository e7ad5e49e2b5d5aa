"""Countdown: the eval-free expression verifier and the solvable-by-construction generator."""
import itertools
from fractions import Fraction

import pytest

from pipelinerl_jax.tasks import CountdownTask, Problem
from pipelinerl_jax.tasks.countdown import ExpressionError, evaluate

PROBLEM = Problem("p", "1 3 4 6 to 24:", {"numbers": [1, 3, 4, 6], "target": 24})


@pytest.mark.parametrize("text,value,literals", [
    ("1+2*3", 7, [1, 2, 3]),
    ("(1+2)*3", 9, [1, 2, 3]),
    ("8-3-2", 3, [8, 3, 2]),  # left-associative
    ("8/4/2", 1, [8, 4, 2]),
    ("6/(1-3/4)", 24, [6, 1, 3, 4]),  # rational intermediates are exact
    (" ( 2 ) ", 2, [2]),
    ("7/2", Fraction(7, 2), [7, 2]),
])
def test_evaluate(text, value, literals):
    assert evaluate(text) == (value, literals)


@pytest.mark.parametrize("text,reason", [
    ("", "empty"), ("1+", "parse_error"), ("-1+2", "parse_error"), ("(1+2", "parse_error"),
    ("1 2", "parse_error"), ("1.5*2", "parse_error"), ("2**3", "parse_error"),
    ("__import__('os')", "parse_error"), ("4/(2-2)", "division_by_zero"),
    ("٣+1", "parse_error"),  # non-ASCII digits are not numbers here
    ("(" * 40 + "1" + ")" * 40, "parse_error"),  # nesting limit, not a RecursionError
])
def test_evaluate_rejects(text, reason):
    with pytest.raises(ExpressionError) as e:
        evaluate(text)
    assert e.value.reason == reason


@pytest.mark.parametrize("text,correct,reason", [
    ("6/(1-3/4)", True, "correct"),
    ("6/(1-3/4)=24", True, "correct"),  # a trailing '= target' is allowed
    ("i think so #### 6/(1-3/4)", True, "correct"),  # the part after the last '####'
    ("(6-3+1)*4+1", False, "number_not_available"),  # 1 used twice
    ("(6-3+1)*4*1*1", False, "number_not_available"),
    ("6*4", False, "not_all_numbers_used"),  # 24, but 1 and 3 unused
    ("6*4*3*1", False, "wrong_value"),
    ("6*4/(3-3)", False, "division_by_zero"),
    ("twenty four", False, "parse_error"),
    ("", False, "empty"),
])
def test_reward(text, correct, reason):
    result = CountdownTask().reward(PROBLEM, text)
    assert result.correct is correct and result.reward == float(correct)
    assert result.info["reason"] == reason


def test_numbers_at_most_once_when_not_all_are_required():
    task = CountdownTask(use_all_numbers=False)
    assert task.reward(PROBLEM, "6*4").correct
    assert not task.reward(PROBLEM, "6*4*1*1").correct


def test_generated_problems_are_solvable_and_in_range():
    task = CountdownTask(num_numbers=3, max_operand=10, max_target=50)
    for problem in itertools.islice(task.problems(0), 300):
        numbers, target = problem.answer["numbers"], problem.answer["target"]
        assert len(numbers) == 3 and all(1 <= x <= 10 for x in numbers)
        assert 1 <= target <= 50
        assert problem.prompt == " ".join(map(str, numbers)) + f" to {target}:"
        value, literals = evaluate(problem.meta["solution"])
        assert value == target and sorted(literals) == sorted(numbers)
