"""Key-value lookup environment: the answer is only reachable by querying a hidden store.

Each problem has its own random store of `num_keys` keys (`key_length` lowercase letters)
that the model never sees. The prompt names a start key, ``find qzk=``; the store maps it to
another key (a hop) or to a 4-digit number (the answer). With h hops the model must query h
times, following each key it gets back, then say the number. Tool: ``get <key>;`` answers
``=<value>`` and a newline (``=?`` for a key not in the store, ``=error`` for a malformed call).
A correct episode (model turns | tool replies)::

    find qzk=  get qzk; | =bta\\n | get bta; | =4821\\n | 4821<eos>

Other keys are distractors (numbers or pointers into the store). The answer is a fresh random
number per problem, so nothing about it can be memorised from the prompt.
Verifier: the last line of the final (EOS-ended) turn must equal the number.
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

DEFAULTS = {"num_keys": 6, "min_hops": 1, "max_hops": 2, "key_length": 3}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CALL = re.compile(r"get ([a-z]{1,16});")
_VALUE_DIGITS = 4


class KVLookupEnv(Environment):
    def __init__(self, task: "KVLookupTask", problem: Problem):
        self.task, self.store = task, dict(problem.meta["store"])
        self.problem = problem

    def step(self, turn: ModelTurn) -> EnvReply:
        if self.task.tool_latency_s:
            time.sleep(self.task.tool_latency_s)  # a slow tool, for experiments
        if turn.ended_with_eos:
            return final_answer_reply(self.task, self.problem, turn)
        call = _CALL.fullmatch(last_line(turn.text))
        if call is None:
            return EnvReply.say("=error\n")
        return EnvReply.say(f"={self.store.get(call.group(1), '?')}\n")


class KVLookupTask(EnvTask):
    """Follow `min_hops..max_hops` keys through a hidden store (module docstring)."""

    name = "kv_lookup"
    turn_stop_texts = (";",)

    def __init__(self, num_keys: int = 6, min_hops: int = 1, max_hops: int = 2,
                 key_length: int = 3, truncated_reward: float = 0.0,
                 tool_latency_s: float = 0.0):
        if not 1 <= min_hops <= max_hops <= num_keys <= 64:
            raise ValueError(f"need 1 <= min_hops <= max_hops <= num_keys <= 64, got "
                             f"{min_hops}, {max_hops}, {num_keys}")
        if not 2 <= key_length <= 8 or 26 ** key_length < 4 * num_keys:
            raise ValueError(f"key_length must be in [2, 8] with room for {num_keys} keys")
        self.num_keys, self.min_hops, self.max_hops = num_keys, min_hops, max_hops
        self.key_length, self.tool_latency_s = key_length, float(tool_latency_s)
        self.truncated_reward = float(truncated_reward)
        self.reward_range = (min(0.0, self.truncated_reward), 1.0)
        self.default_max_turns = max_hops + 2  # the lookups, the answer, one slip
        value = max(key_length, _VALUE_DIGITS)
        self.max_prompt_chars = len("find ") + key_length + 1
        # per lookup "get " key ";" "=" value "\n", then the number and EOS
        self.max_completion_tokens = (max_hops * (4 + key_length + 1 + 1 + value + 1)
                                      + _VALUE_DIGITS + 1)

    def _key(self, rng: np.random.Generator) -> str:
        return "".join(_LETTERS[int(i)] for i in rng.integers(0, 26, self.key_length))

    def _generate(self, rng: np.random.Generator) -> tuple[str, Any, dict]:
        hops = int(rng.integers(self.min_hops, self.max_hops + 1))
        keys: list[str] = []
        while len(keys) < self.num_keys:
            k = self._key(rng)
            if k not in keys:
                keys.append(k)
        answer = str(int(rng.integers(10 ** (_VALUE_DIGITS - 1), 10 ** _VALUE_DIGITS)))
        store = {k: keys[i + 1] for i, k in enumerate(keys[:hops - 1])}
        store[keys[hops - 1]] = answer
        for k in keys[hops:]:  # distractors: numbers, or pointers to any key
            if rng.random() < 0.5:
                store[k] = keys[int(rng.integers(0, self.num_keys))]
            else:
                store[k] = str(int(rng.integers(10 ** (_VALUE_DIGITS - 1), 10 ** _VALUE_DIGITS)))
        order = [keys[int(i)] for i in rng.permutation(self.num_keys)]
        return (f"find {keys[0]}=", answer,
                {"store": {k: store[k] for k in order}, "chain": keys[:hops], "hops": hops})

    def make_env(self, problem: Problem) -> KVLookupEnv:
        return KVLookupEnv(self, problem)

    def demonstration_turns(self, problem: Problem) -> list[tuple[str, str]]:
        store = problem.meta["store"]
        turns = [(f"get {k};", f"={store[k]}\n") for k in problem.meta["chain"]]
        return turns + [(str(problem.answer), "")]

    def score_answer(self, problem: Problem, answer: str) -> tuple[float, bool, dict]:
        ok = answer == problem.answer
        return float(ok), ok, {"answer": answer[:32]}


def from_config(cfg: Any, prefix: str = "env") -> KVLookupTask:
    """Validates the kv_lookup keys of an `env` section (errors name the key) and builds it."""
    c = nested(prefix, cfg)
    num = cfglib.positive_int(c, f"{prefix}.num_keys")
    lo = cfglib.positive_int(c, f"{prefix}.min_hops")
    hi = cfglib.positive_int(c, f"{prefix}.max_hops")
    if not lo <= hi <= num:
        raise cfglib.ConfigError(f"{prefix}.max_hops",
                                 f"must be in [min_hops={lo}, num_keys={num}], got {hi}")
    if num > 64:
        raise cfglib.ConfigError(f"{prefix}.num_keys", f"must be <= 64, got {num}")
    length = cfglib.positive_int(c, f"{prefix}.key_length")
    if not 2 <= length <= 8:
        raise cfglib.ConfigError(f"{prefix}.key_length", f"must be in [2, 8], got {length}")
    return KVLookupTask(num, lo, hi, length,
                        cfglib.number(c, f"{prefix}.truncated_reward", lo=-1.0, hi=1.0),
                        cfglib.number(c, f"{prefix}.tool_latency_s", lo=0.0))
