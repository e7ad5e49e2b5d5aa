"""The calculator and key-value environments: verifiers, tool answers, the task contract
(seeded streams, disjoint eval split, correct demonstrations within the size hints) and the
`env` config section."""
import itertools
import json

import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.envs import (CalculatorTask, KVLookupTask, ModelTurn, encode_demonstration,
                                 env_config, get_env_task, make_runner, runner_options)
from pipelinerl_jax.envs.calculator import CalcError, evaluate
from pipelinerl_jax.tasks import is_held_out
from tests.envs.scripted_engine import ScriptedEngine

TASKS = [CalculatorTask(), CalculatorTask(min_ops=2, max_ops=2, max_operand=9),
         KVLookupTask(), KVLookupTask(num_keys=10, min_hops=3, max_hops=4, key_length=2)]


def turn(text, eos=False, index=0):
    return ModelTurn(index=index, token_ids=np.zeros(1, np.int32), text=text,
                     stop_text="" if eos else ";", ended_with_eos=eos)


@pytest.mark.parametrize("expr,max_ops,value", [
    ("12*34", 1, 408), ("2+3*4", 2, 14), ("(2+3)*4", 2, 20), ("-3*-4", 1, 12),
    ("3--4", 1, 7), ("((7))", 0, 7), ("1 + 2", 1, 3), ("999999*999999", 1, 999998000001)])
def test_evaluate(expr, max_ops, value):
    assert evaluate(expr, max_ops=max_ops) == value


@pytest.mark.parametrize("expr", [
    "", "1+2+3", "2**10", "1/2", "__import__('os')", "1+", "(1+2", "1+2)", "9" * 16,
    "(" * 10 + "1" + ")" * 10, "x" * 65, "99999999*99999999", "1e5", "0x10", None])
def test_evaluate_refuses(expr):
    with pytest.raises(CalcError):
        evaluate(expr, max_ops=1)


def test_calculator_tool_and_verifier():
    task = CalculatorTask()
    p = next(p for p in task.problems(0) if p.meta["num_ops"] == 2)
    env = task.make_env(p)
    assert env.step(turn("calc 12*34;")).text == "=408\n"
    assert env.step(turn("=5\ncalc -7+1;")).text == "=-6\n"  # the last line is the call
    for bad in ("calc 1+2+3;", "calc;", "cal 1+2;", "calc 1/2;", "hello;", ""):
        assert env.step(turn(bad)).text == "=error\n", bad
    a = str(p.answer)
    right = env.step(turn(a, eos=True))
    assert right.done and right.correct and right.reward == 1.0
    for wrong in (str(p.answer + 1), a + "x", "", "calc 1+1;", f"{a} {a}"):
        r = env.step(turn(wrong, eos=True))
        assert r.done and not r.correct and r.reward == 0.0, wrong
    assert env.step(turn(f"junk\n {a} ", eos=True)).correct  # the last line, stripped
    assert task.max_ops_per_call == 1 and CalculatorTask(max_ops_per_call=3).make_env(p).step(
        turn("calc 1+2*3;")).text == "=7\n"


def test_kv_tool_and_verifier():
    task = KVLookupTask(min_hops=2, max_hops=2)
    p = next(task.problems(0))
    store, chain = p.meta["store"], p.meta["chain"]
    assert len(store) == task.num_keys and len(chain) == 2 and p.prompt == f"find {chain[0]}="
    assert store[chain[0]] == chain[1] and store[chain[1]] == p.answer
    assert p.answer not in p.prompt
    env = task.make_env(p)
    assert env.step(turn(f"get {chain[0]};")).text == f"={chain[1]}\n"
    missing = next(k for k in ("zzz", "qqq", "abc") if k not in store)
    assert env.step(turn(f"get {missing};")).text == "=?\n"
    for bad in ("get;", "get ABC;", "fetch abc;", "get a b;"):
        assert env.step(turn(bad)).text == "=error\n", bad
    assert env.step(turn(p.answer, eos=True)).correct
    assert not env.step(turn(chain[1], eos=True)).correct


@pytest.mark.parametrize("task", TASKS, ids=lambda t: f"{t.name}-{t.max_completion_tokens}")
def test_task_contract(task, tok):
    first = list(itertools.islice(task.problems(3), 50))
    assert [(p.prompt, p.answer, p.meta) for p in first] == [
        (p.prompt, p.answer, p.meta) for p in itertools.islice(task.problems(3), 50)]
    assert [p.prompt for p in first] != [p.prompt for p in itertools.islice(task.problems(4), 50)]
    evals = task.eval_problems(12)
    assert task.eval_problems(5) == evals[:5] and all(is_held_out(p.prompt) for p in evals)
    train = [p for s in (0, 1) for p in itertools.islice(task.problems(s), 500)]
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    longest = 0
    for p in train + evals:
        turns = task.demonstration_turns(p)
        assert len(turns) <= task.default_max_turns
        assert all(m.endswith(";") and e.startswith("=") and e.endswith("\n")
                   for m, e in turns[:-1]) and turns[-1][1] == ""
        demo = task.demonstration(p)
        result = task.reward(p, demo)
        assert result.correct and result.reward == 1.0, (p, demo)
        assert not task.reward(p, demo, "length").correct
        assert len(p.prompt) <= task.max_prompt_chars
        assert len(demo) + 1 <= task.max_completion_tokens
        longest = max(longest, len(demo) + 1)
        prompt, ids, mask = encode_demonstration(task, tok, p)  # char-vocabulary friendly
        assert tok.decode(ids) == demo and ids[-1] == tok.eos_id and mask[-1] == 1
        assert mask.sum() == sum(len(m) for m, _ in turns) + 1
        json.dumps([p.answer, p.meta])
    assert longest > task.max_completion_tokens // 3  # the hint is not wildly loose


@pytest.mark.parametrize("task", TASKS[::2], ids=lambda t: t.name)
def test_reward_never_raises(task):
    p = task.eval_problems(1)[0]
    for text in ("", None, "\n\n", "9" * 100_000, "-" * 1000, "\x00\udcff", 17, "=error\n"):
        r = task.reward(p, text)
        assert not r.correct and r.reward == 0.0


def test_env_config_validation_names_the_key():
    assert isinstance(get_env_task(env_config("calculator")), CalculatorTask)
    task = get_env_task(env_config("kv_lookup", max_hops=3, tool_latency_s=0.01))
    assert isinstance(task, KVLookupTask) and task.max_hops == 3 and task.tool_latency_s == 0.01
    for overrides, key in [({"max_ops": 0}, "env.max_ops"), ({"min_ops": 4}, "env.max_ops"),
                           ({"max_operand": 10**5}, "env.max_operand"),
                           ({"tool_timeout_s": 0.0}, "env.tool_timeout_s"),
                           ({"max_turn_tokens": 0}, "env.max_turn_tokens"),
                           ({"dynamic_sampling": 1}, "env.dynamic_sampling"),
                           ({"name": "chess"}, "env.name")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            get_env_task({**env_config().to_dict(), **overrides})
    with pytest.raises(ConfigError, match=r"env\.max_hops"):
        get_env_task(env_config("kv_lookup", max_hops=9, num_keys=6))
    with pytest.raises(ConfigError, match=r"env\.typo"):
        env_config(typo=1)
    assert runner_options(env_config()) == dict(
        max_turns=None, max_turn_tokens=32, max_episode_tokens=None, max_env_tokens=64,
        tool_threads=16, tool_timeout_s=10.0)


def test_make_runner_uses_the_section(tok):
    cfg = env_config("kv_lookup", max_turns=5, max_episode_tokens=100, tool_threads=2)
    runner = make_runner(cfg, ScriptedEngine(lambda r, i: [2]), tok, temperature=0.5)
    assert (runner.max_turns, runner.max_episode_tokens, runner.pool.num_threads) == (5, 100, 2)
    assert runner.stop_ids == (tok.eos_id, tok.encode(";")[0]) and runner.task.name == "kv_lookup"
    default = make_runner(env_config("calculator"), ScriptedEngine(lambda r, i: [2]), tok)
    assert default.max_turns == default.task.default_max_turns == 5
    assert default.max_episode_tokens == 256  # the engine's context
    runner.close()
    default.close()
