"""Calculator environment: multi-step integer arithmetic that needs a pocket calculator.

A problem is a left-nested expression over 1..`max_operand` with + - *, e.g.
``(12*34)+56=``. The tool takes one call per turn, ``calc <expr>;``, and answers ``=<value>``
and a newline; by default it evaluates one operation per call (`max_ops_per_call=1`), so a
problem with k operations takes k calls, then the answer line and EOS. A correct episode
(model turns | tool replies)::

    (12*34)+56=  calc 12*34; | =408\\n | calc 408+56; | =464\\n | 464<eos>

A tiny char model cannot multiply 2-digit numbers in its head; it can learn to copy operands
and results, which is what the tool makes sufficient. Every character is in `CHAR_VOCAB`.
A malformed call or an expression the tool refuses gets ``=error`` (feedback, not the end).

Verifier: the last line of the final (EOS-ended) turn must be the integer value, evaluated
left to right as the parentheses say. The evaluator is a small recursive-descent parser (never
`eval`): integers, + - *, parentheses, bounded length, depth and magnitude.
"""
from __future__ import annotations

import re
import time
from typing import Any

import numpy as np

from pipelinerl_jax import config_checks as cfglib
from pipelinerl_jax.envs.base import (EnvReply, EnvTask, Environment, ModelTurn,
                                      final_answer_reply, last_line)
from pipelinerl_jax.tasks.base import Problem, nested

OPS = "+-*"
DEFAULTS = {"min_ops": 1, "max_ops": 3, "max_operand": 99, "max_ops_per_call": 1}
_CALL = re.compile(r"calc (.{1,64});")
_ANSWER = re.compile(r"-?\d{1,24}")


class CalcError(ValueError):
    """An expression the calculator refuses (syntax, too many operations, too large)."""


def evaluate(expr: str, max_ops: int = 1, max_chars: int = 64, max_abs: int = 10**15) -> int:
    """The integer value of `expr` (+ - * and parentheses, usual precedence)."""
    if not isinstance(expr, str) or not 0 < len(expr) <= max_chars:
        raise CalcError("empty or too long")
    toks = re.findall(r"\d+|[-+*()]|\S", expr.replace(" ", ""))
    pos, ops = 0, 0

    def peek():
        return toks[pos] if pos < len(toks) else ""

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def check(v: int) -> int:
        if abs(v) > max_abs:
            raise CalcError("result too large")
        return v

    def binary(op: str, a: int, b: int) -> int:
        nonlocal ops
        ops += 1
        if ops > max_ops:
            raise CalcError(f"more than {max_ops} operations in one call")
        return check(a + b if op == "+" else a - b if op == "-" else a * b)

    def factor(depth: int) -> int:
        t = take() if peek() else ""
        if t == "-":
            return check(-factor(depth))
        if t == "(":
            if depth > 8:
                raise CalcError("nested too deep")
            v = expression(depth + 1)
            if (take() if peek() else "") != ")":
                raise CalcError("missing )")
            return v
        if t.isdigit() and len(t) <= 15:
            return int(t)
        raise CalcError(f"unexpected {t!r}")

    def term(depth: int) -> int:
        v = factor(depth)
        while peek() == "*":
            take()
            v = binary("*", v, factor(depth))
        return v

    def expression(depth: int) -> int:
        v = term(depth)
        while peek() in ("+", "-"):
            v = binary(take(), v, term(depth))
        return v

    value = expression(0)
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]!r}")
    return value


class CalculatorEnv(Environment):
    def __init__(self, task: "CalculatorTask", problem: Problem):
        self.task, self.problem = task, problem

    def step(self, turn: ModelTurn) -> EnvReply:
        if self.task.tool_latency_s:
            time.sleep(self.task.tool_latency_s)  # a slow tool, for experiments
        if turn.ended_with_eos:
            return final_answer_reply(self.task, self.problem, turn)
        call = _CALL.fullmatch(last_line(turn.text))
        if call is None:
            return EnvReply.say("=error\n")
        try:
            return EnvReply.say(f"={evaluate(call.group(1), self.task.max_ops_per_call)}\n")
        except CalcError:
            return EnvReply.say("=error\n")


class CalculatorTask(EnvTask):
    """Left-nested arithmetic over `min_ops..max_ops` operations (module docstring)."""

    name = "calculator"
    turn_stop_texts = (";",)

    def __init__(self, min_ops: int = 1, max_ops: int = 3, max_operand: int = 99,
                 max_ops_per_call: int = 1, truncated_reward: float = 0.0,
                 tool_latency_s: float = 0.0):
        if not 1 <= min_ops <= max_ops <= 8:
            raise ValueError(f"need 1 <= min_ops <= max_ops <= 8, got {min_ops}, {max_ops}")
        if not 1 <= max_operand <= 9999 or max_ops_per_call < 1:
            raise ValueError("need 1 <= max_operand <= 9999 and max_ops_per_call >= 1")
        self.min_ops, self.max_ops, self.max_operand = min_ops, max_ops, max_operand
        self.max_ops_per_call, self.tool_latency_s = max_ops_per_call, float(tool_latency_s)
        self.truncated_reward = float(truncated_reward)
        self.reward_range = (min(0.0, self.truncated_reward), 1.0)
        self.default_max_turns = max_ops + 2  # the calls, the answer, one slip
        d_op = len(str(max_operand))
        bound = max_operand
        for _ in range(max_ops):
            bound = (bound + 1) * max_operand
        d = len(str(bound)) + 1  # sign
        self.max_prompt_chars = (max_ops + 1) * d_op + max_ops + 2 * (max_ops - 1) + 1
        # per call "calc " a op b ";" "=" value "\n", then the answer and EOS
        self.max_completion_tokens = max_ops * (5 + d + 1 + d_op + 1 + 1 + d + 1) + d + 1

    def _generate(self, rng: np.random.Generator) -> tuple[str, Any, dict]:
        n = int(rng.integers(self.min_ops, self.max_ops + 1))
        nums = [int(x) for x in rng.integers(1, self.max_operand + 1, n + 1)]
        ops = [OPS[int(i)] for i in rng.integers(0, len(OPS), n)]
        expr, acc, steps = str(nums[0]), nums[0], []
        for i, (op, b) in enumerate(zip(ops, nums[1:])):
            if i:
                expr = f"({expr})"
            expr += f"{op}{b}"
            res = evaluate(f"{acc}{op}{b}")
            steps.append([acc, op, b, res])
            acc = res
        return expr + "=", acc, {"steps": steps, "num_ops": n}

    def make_env(self, problem: Problem) -> CalculatorEnv:
        return CalculatorEnv(self, problem)

    def demonstration_turns(self, problem: Problem) -> list[tuple[str, str]]:
        turns = [(f"calc {a}{op}{b};", f"={r}\n") for a, op, b, r in problem.meta["steps"]]
        return turns + [(str(problem.answer), "")]

    def score_answer(self, problem: Problem, answer: str) -> tuple[float, bool, dict]:
        if not _ANSWER.fullmatch(answer):
            return 0.0, False, {"reason": "not an integer"}
        ok = int(answer) == int(problem.answer)
        return float(ok), ok, {"answer": answer[:32]}


def from_config(cfg: Any, prefix: str = "env") -> CalculatorTask:
    """Validates the calculator keys of an `env` section (errors name the key) and builds it."""
    c = nested(prefix, cfg)
    lo = cfglib.positive_int(c, f"{prefix}.min_ops")
    hi = cfglib.positive_int(c, f"{prefix}.max_ops")
    if not lo <= hi <= 8:
        raise cfglib.ConfigError(f"{prefix}.max_ops", f"must be in [min_ops={lo}, 8], got {hi}")
    operand = cfglib.positive_int(c, f"{prefix}.max_operand")
    if operand > 9999:
        raise cfglib.ConfigError(f"{prefix}.max_operand", f"must be <= 9999, got {operand}")
    return CalculatorTask(lo, hi, operand, cfglib.positive_int(c, f"{prefix}.max_ops_per_call"),
                          cfglib.number(c, f"{prefix}.truncated_reward", lo=-1.0, hi=1.0),
                          cfglib.number(c, f"{prefix}.tool_latency_s", lo=0.0))
