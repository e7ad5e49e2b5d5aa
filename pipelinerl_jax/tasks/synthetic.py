"""Synthetic string tasks with a long-tailed output length: reverse (default), copy, sort.

A problem is a string of lowercase letters followed by '='; the answer is the string
reversed (or copied, or with its letters sorted), e.g. ``"abcde="`` -> ``"edcba"`` then EOS.
A 2-layer character-level transformer learns this from scratch in minutes on a CPU.

The string length L, which is also the required output length, is drawn from a lognormal
distribution so that a few samples are much longer than the rest (the stragglers that
pipeline RL is about)::

    L = clip(round(exp(mu + sigma * Z)), min_length, max_length),  Z ~ N(0, 1)
    mu = ln(median_length),  sigma = (ln(p99_length) - ln(median_length)) / z_0.99

with z_0.99 = 2.3263 the 99th percentile of N(0, 1). Clipping (rather than resampling)
keeps the configured median and p99 exact when they lie inside [min_length, max_length];
the cost is a small spike at the cap (0.28% of samples at the defaults 12 / 69 / 96).

Reward: 1.0 for an exact match (surrounding whitespace ignored), else 0.0; with
``partial_credit='prefix'`` a wrong answer earns ``k / max(len(target), len(output))``, the
length of the longest common prefix k over the longer of the two, so over-long outputs are
penalised too. `correct` is always the exact match.
"""
from __future__ import annotations

import math
import os
import statistics
from typing import Any

import numpy as np

from pipelinerl_jax import config_checks as cfglib
from pipelinerl_jax.tasks.base import GeneratedTask, Problem, nested

_Z99 = statistics.NormalDist().inv_cdf(0.99)
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)

VARIANTS = {
    "reverse": lambda s: s[::-1],
    "copy": lambda s: s,
    "sort": lambda s: "".join(sorted(s)),
}
DEFAULTS = {"median_length": 12.0, "p99_length": 69.0, "min_length": 1, "max_length": 96,
            "partial_credit": "none"}
PARTIAL_CREDIT = ("none", "prefix")


class SyntheticStringTask(GeneratedTask):
    """One of `VARIANTS` over lognormal-length strings of lowercase letters."""

    def __init__(self, variant: str = "reverse", median_length: float = 12.0,
                 p99_length: float = 69.0, min_length: int = 1, max_length: int = 96,
                 partial_credit: str = "none", truncated_reward: float = 0.0):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
        if not 1 <= min_length <= median_length <= max_length or p99_length < median_length:
            raise ValueError("need 1 <= min_length <= median_length <= max_length and "
                             f"p99_length >= median_length, got {min_length}, {median_length}, "
                             f"{max_length}, {p99_length}")
        if partial_credit not in PARTIAL_CREDIT:
            raise ValueError(f"partial_credit must be one of {PARTIAL_CREDIT}, "
                             f"got {partial_credit!r}")
        self.name = variant
        self._transform = VARIANTS[variant]
        self.min_length, self.max_length = int(min_length), int(max_length)
        self.mu = math.log(median_length)
        self.sigma = (math.log(p99_length) - math.log(median_length)) / _Z99
        self.partial_credit = partial_credit
        self.truncated_reward = float(truncated_reward)
        self.reward_range = (min(0.0, self.truncated_reward), 1.0)
        self.max_prompt_chars = self.max_length + 1  # the letters and '='
        self.max_completion_tokens = self.max_length + 1  # the answer and EOS

    def sample_length(self, rng: np.random.Generator) -> int:
        x = self.mu + self.sigma * rng.standard_normal()
        if x > math.log(self.max_length + 1):  # also keeps exp() from overflowing
            return self.max_length
        return int(min(max(round(math.exp(x)), self.min_length), self.max_length))

    def _generate(self, rng: np.random.Generator) -> tuple[str, Any, dict]:
        length = self.sample_length(rng)
        text = _LETTERS[rng.integers(0, len(_LETTERS), length)].tobytes().decode("ascii")
        return text + "=", self._transform(text), {"length": length}

    def demonstration(self, problem: Problem) -> str:
        return problem.answer

    def _score(self, problem: Problem, text: str) -> tuple[float, bool, dict]:
        target, output = problem.answer, text.strip()
        prefix = len(os.path.commonprefix([target, output]))
        info = {"target_length": len(target), "output_length": len(output),
                "prefix_match": prefix}
        if output == target:
            return 1.0, True, info
        if self.partial_credit == "prefix":
            return prefix / max(len(target), len(output)), False, info
        return 0.0, False, info


def from_config(name: str, cfg: Any, prefix: str = "task") -> SyntheticStringTask:
    """Validates the synthetic keys of a task section (errors name the key) and builds it."""
    c = nested(prefix, cfg)
    min_length = cfglib.positive_int(c, f"{prefix}.min_length")
    max_length = cfglib.positive_int(c, f"{prefix}.max_length")
    if max_length < min_length:
        raise cfglib.ConfigError(f"{prefix}.max_length",
                                 f"must be >= {prefix}.min_length={min_length}, got {max_length}")
    median = cfglib.number(c, f"{prefix}.median_length", lo=min_length, hi=max_length)
    p99 = cfglib.number(c, f"{prefix}.p99_length", lo=median)
    partial = cfglib.one_of(c, f"{prefix}.partial_credit", PARTIAL_CREDIT)
    truncated = cfglib.number(c, f"{prefix}.truncated_reward", lo=-1.0, hi=1.0)
    return SyntheticStringTask(name, median, p99, min_length, max_length, partial, truncated)
