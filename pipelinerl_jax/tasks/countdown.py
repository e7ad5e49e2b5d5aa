"""Countdown: combine the given numbers with + - * / and parentheses to reach a target.

Prompt ``"3 5 7 11 to 24:"``; a correct completion is an expression such as ``(11-5)*(7-3)``.

Generation is solvable by construction: draw `num_numbers` integers in [1, max_operand],
then repeatedly replace two random pool entries a, b by one of a+b, |a-b| (if non-zero),
a*b, max/min (if exact) until one value is left; that value is the target (a problem is
redrawn unless 1 <= target <= max_target). The construction's expression, printed with the
fewest parentheses, is the demonstration.

Verification never calls `eval`: a recursive-descent parser over the grammar
``expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
factor := INT | '(' expr ')'`` evaluates with exact rational arithmetic (`Fraction`).
Unary minus, decimals and every other symbol are parse errors; division by zero is reported
as such. With ``use_all_numbers=True`` (default, as in TinyZero's Countdown) every given
number must be used exactly once; with False, at most once. The expression is the text after
the last '####' if there is one, else the whole completion, cut before its first '=' (so
``(11-5)*(7-3)=24`` is accepted). Reward 1.0 iff the value equals the target, else 0.0.
"""
from __future__ import annotations

import collections
import operator
import re
from fractions import Fraction
from typing import Any

import numpy as np

from pipelinerl_jax import config_checks as cfglib
from pipelinerl_jax.tasks.base import GeneratedTask, Problem, nested

DEFAULTS = {"num_numbers": 4, "max_operand": 25, "max_target": 100, "use_all_numbers": True}
MAX_EXPRESSION_CHARS = 256
MAX_NESTING = 32
_TOKEN = re.compile(r"\s*([0-9]+|[-+*/()])")  # ASCII digits only: int() takes more
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


class ExpressionError(ValueError):
    """The completion is not a valid expression; `reason` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def _tokenize(text: str) -> list[str]:
    tokens, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ExpressionError("parse_error", f"unexpected {text[pos]!r} at {pos}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """Value of an arithmetic expression and the integer literals it uses, in order."""
    tokens, pos, literals = _tokenize(text), 0, []

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def factor(depth: int) -> Fraction:
        nonlocal pos
        tok = peek()
        if tok is None:
            raise ExpressionError("parse_error", "expression ends early")
        pos += 1
        if tok[0] in "0123456789":
            literals.append(int(tok))
            return Fraction(int(tok))
        if tok == "(":
            if depth >= MAX_NESTING:
                raise ExpressionError("parse_error", "parentheses nested too deeply")
            value = expr(depth + 1)
            if peek() != ")":
                raise ExpressionError("parse_error", "missing ')'")
            pos += 1
            return value
        raise ExpressionError("parse_error", f"unexpected {tok!r}")

    def binary(depth: int, ops: str, operand) -> Fraction:
        """One precedence level: operand (op operand)*, left-associative."""
        nonlocal pos
        value = operand(depth)
        while peek() is not None and peek() in ops:
            op = tokens[pos]
            pos += 1
            rhs = operand(depth)
            if op == "/" and rhs == 0:
                raise ExpressionError("division_by_zero")
            value = _APPLY[op](value, rhs)
        return value

    def term(depth: int) -> Fraction:
        return binary(depth, "*/", factor)

    def expr(depth: int) -> Fraction:
        return binary(depth, "+-", term)

    if not tokens:
        raise ExpressionError("empty")
    value = expr(0)
    if pos != len(tokens):
        raise ExpressionError("parse_error", f"unexpected {tokens[pos]!r} after the expression")
    return value, literals


def _combine(a: tuple[int, str, int], b: tuple[int, str, int], op: str) -> tuple[int, str, int]:
    """(value, text, precedence) of `a op b`, parenthesising an operand only where needed."""
    prec = _PRECEDENCE[op]
    left = f"({a[1]})" if a[2] < prec else a[1]
    # The right operand of '-' and '/' also needs parentheses at equal precedence.
    right = f"({b[1]})" if b[2] < prec or (b[2] == prec and op in "-/") else b[1]
    value = a[0] // b[0] if op == "/" else _APPLY[op](a[0], b[0])  # '/' only when exact
    return value, f"{left}{op}{right}", prec


class CountdownTask(GeneratedTask):
    name = "countdown"

    def __init__(self, num_numbers: int = 4, max_operand: int = 25, max_target: int = 100,
                 use_all_numbers: bool = True, truncated_reward: float = 0.0):
        if not (2 <= num_numbers <= 8 and max_operand >= 1 and max_target >= 1):
            raise ValueError("need 2 <= num_numbers <= 8, max_operand >= 1, max_target >= 1")
        self.num_numbers, self.max_operand = int(num_numbers), int(max_operand)
        self.max_target, self.use_all_numbers = int(max_target), bool(use_all_numbers)
        self.truncated_reward = float(truncated_reward)
        self.reward_range = (min(0.0, self.truncated_reward), 1.0)
        digits, n = len(str(self.max_operand)), self.num_numbers
        self.max_prompt_chars = n * (digits + 1) + len(f"to {self.max_target}:")
        # Literals, n-1 operators and at most n-1 pairs of parentheses, then EOS.
        self.max_completion_tokens = n * digits + 3 * (n - 1) + 1

    def _generate(self, rng: np.random.Generator) -> tuple[str, Any, dict]:
        for _ in range(10_000):
            numbers = [int(x) for x in rng.integers(1, self.max_operand + 1, self.num_numbers)]
            pool = [(x, str(x), 3) for x in numbers]
            while len(pool) > 1:
                i, j = (int(k) for k in rng.choice(len(pool), 2, replace=False))
                a, b = pool[i], pool[j]
                if a[0] < b[0]:
                    a, b = b, a  # a >= b, so a-b >= 0 and a/b can be exact
                ops = ["+", "*"] + (["-"] if a[0] > b[0] else []) + (
                    ["/"] if a[0] % b[0] == 0 and b[0] > 1 else [])
                merged = _combine(a, b, ops[int(rng.integers(len(ops)))])
                pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [merged]
            target, solution = pool[0][0], pool[0][1]
            if 1 <= target <= self.max_target:
                break
        else:
            raise ValueError(f"countdown: no target in [1, {self.max_target}] after 10000 draws "
                             f"with max_operand={self.max_operand}; raise max_target")
        prompt = " ".join(map(str, numbers)) + f" to {target}:"
        return prompt, {"numbers": numbers, "target": target}, {"solution": solution}

    def demonstration(self, problem: Problem) -> str:
        return problem.meta["solution"]

    def _score(self, problem: Problem, text: str) -> tuple[float, bool, dict]:
        candidate = text[text.rfind("####") + 4:] if "####" in text else text
        candidate = candidate.split("=", 1)[0].strip()
        if len(candidate) > MAX_EXPRESSION_CHARS:
            return 0.0, False, {"reason": "too_long"}
        try:
            value, literals = evaluate(candidate)
        except ExpressionError as e:
            return 0.0, False, {"reason": e.reason}
        info = {"value": float(value) if abs(value) < 1e300 else None}
        given, used = collections.Counter(problem.answer["numbers"]), collections.Counter(literals)
        if any(used[x] > given[x] for x in used):
            return 0.0, False, {**info, "reason": "number_not_available"}
        if self.use_all_numbers and used != given:
            return 0.0, False, {**info, "reason": "not_all_numbers_used"}
        if value != problem.answer["target"]:
            return 0.0, False, {**info, "reason": "wrong_value"}
        return 1.0, True, {**info, "reason": "correct"}


def from_config(name: str, cfg: Any, prefix: str = "task") -> CountdownTask:
    """Validates the countdown keys of a task section (errors name the key) and builds it."""
    c = nested(prefix, cfg)
    num = cfglib.positive_int(c, f"{prefix}.num_numbers")
    if not 2 <= num <= 8:
        raise cfglib.ConfigError(f"{prefix}.num_numbers", f"must be in [2, 8], got {num}")
    use_all = cfglib.get(c, f"{prefix}.use_all_numbers")
    if not isinstance(use_all, bool):
        raise cfglib.ConfigError(f"{prefix}.use_all_numbers", f"must be a bool, got {use_all!r}")
    return CountdownTask(num, cfglib.positive_int(c, f"{prefix}.max_operand"),
                         cfglib.positive_int(c, f"{prefix}.max_target"), use_all,
                         cfglib.number(c, f"{prefix}.truncated_reward", lo=-1.0, hi=1.0))
