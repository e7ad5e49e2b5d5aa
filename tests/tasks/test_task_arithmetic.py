"""The multi-step addition task (`add`): answers are the sums, the size hints are exact, the
digit counts are drawn as stated, only the exact sum scores, and bad config keys are named."""
import collections
import itertools

import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.tasks import AdditionTask, get_task, task_config


def test_answers_are_the_sums_and_fit_the_size_hints():
    for terms, digits in ((2, 1), (3, 3), (8, 4)):
        task = AdditionTask(terms, digits)
        problems = list(itertools.islice(task.problems(0), 2000)) + task.eval_problems(50)
        for p in problems:
            ops = [int(x[::-1]) for x in p.prompt.rstrip("=").split("+")]  # lsb first
            assert len(ops) == terms and p.answer == str(sum(ops))[::-1]  # lsb first
            assert ops == p.meta["operands"] and p.meta["sum"] == sum(ops)
            assert all(len(x) == digits for x in p.prompt.rstrip("=").split("+"))
            assert len(p.prompt) <= task.max_prompt_chars
            assert len(p.answer) + 1 <= task.max_completion_tokens  # the answer and EOS
        # the bound is reached: the longest sum uses the whole completion budget
        widest = str(terms * (10 ** digits - 1))
        assert len(widest) + 1 == task.max_completion_tokens


def test_operand_digits_are_uniform_at_every_position():
    task = AdditionTask(3, 3)
    ops = [x for p in itertools.islice(task.problems(1), 3000)
           for x in p.prompt.rstrip("=").split("+")]
    for pos in range(3):
        counts = collections.Counter(x[pos] for x in ops)
        assert set(counts) == set("0123456789")
        assert all(abs(n / len(ops) - 0.1) < 0.02 for n in counts.values())


def test_only_the_exact_sum_in_the_task_digit_order_scores():
    lsb, msb = AdditionTask(3, 3), AdditionTask(3, 3, "msb")
    p, q = next(lsb.problems(0)), next(msb.problems(0))
    assert p.meta["operands"] == q.meta["operands"]  # the same stream, written two ways
    assert p.answer == q.answer[::-1] == str(p.meta["sum"])[::-1]
    assert p.prompt == "+".join(x[::-1] for x in q.prompt.rstrip("=").split("+")) + "="
    for task, prob in ((lsb, p), (msb, q)):
        assert task.reward(prob, prob.answer).correct
        assert task.reward(prob, f" {prob.answer}\n").reward == 1.0
        total = str(prob.meta["sum"])
        for wrong in ("+" + prob.answer, "0" + total, total + "0", str(int(total) + 1),
                      prob.prompt + prob.answer):
            r = task.reward(prob, wrong)
            assert r.reward == 0.0 and not r.correct, wrong
    if p.answer != p.answer[::-1]:  # the other order is wrong (not a palindrome)
        assert not lsb.reward(p, q.answer).correct and not msb.reward(q, p.answer).correct


@pytest.mark.parametrize("overrides,key", [({"terms": 1}, "task.terms"),
                                           ({"terms": 9}, "task.terms"),
                                           ({"digits": 0}, "task.digits"),
                                           ({"digits": 13}, "task.digits"),
                                           ({"digit_order": "up"}, "task.digit_order")])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        get_task(task_config("add", **overrides))
