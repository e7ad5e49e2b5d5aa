"""The `Task` interface: a seeded prompt stream, a held-out eval split and a verifier.

A task hands out `Problem`s, scores a completion's text with `reward(...)` and can give
demonstrations for a supervised warm start. Three contracts the rest of the system relies on:

* `reward` never raises, whatever the text (empty, garbage, huge, any unicode) and whatever
  the finish reason; a verifier bug becomes reward 0 with `info["error"]` set. A completion
  that did not finish with EOS (`finish_reason != 'stop'`: truncated at the length limit or
  aborted) is never correct and gets `truncated_reward` (default 0), whatever its text.
* `problems(seed)` is deterministic for a seed; different seeds give independent streams
  (numpy `SeedSequence` over (task name, stream, seed)).
* `eval_problems(n)` never meets a training prompt. Generated tasks split the *prompt space*
  by a hash: a prompt is held out iff ``blake2b(prompt) % HELD_OUT_MODULUS == 0`` (1/20 of
  all prompts). Training streams skip held-out prompts and the eval stream keeps only them,
  so the splits are disjoint by construction for every seed. `eval_problems(n)` is a prefix of
  `eval_problems(m)` for n <= m.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import Any, Iterator

import numpy as np

HELD_OUT_MODULUS = 20
_TRAIN_STREAM, _EVAL_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt. `id` reproduces it (e.g. 'reverse/s3/i17': seed 3, 17th problem)."""
    id: str
    prompt: str
    answer: Any  # JSON-able; what the verifier compares against
    meta: dict = dataclasses.field(default_factory=dict)  # JSON-able extras (lengths, solution)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool  # exact correctness, independent of any partial-credit shaping
    info: dict  # JSON-able diagnostics (reason, extracted answer, ...); for logs only


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


def is_held_out(prompt: str) -> bool:
    """Whether `prompt` belongs to the eval split of a generated task (1 in HELD_OUT_MODULUS)."""
    return stable_hash(prompt) % HELD_OUT_MODULUS == 0


def non_negative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


class Task(abc.ABC):
    """A task with a verifiable reward. Subclasses set the attributes and implement `_score`.

    `max_prompt_chars` bounds the prompt text length (in characters, so with `CharTokenizer`
    it bounds prompt tokens, plus one for BOS). `max_completion_tokens` is the completion
    budget the engine should allow: for generated tasks the longest correct answer in
    characters plus one EOS (exact with `CharTokenizer`); for text datasets a config value.
    """

    name: str
    max_prompt_chars: int
    max_completion_tokens: int
    truncated_reward: float = 0.0
    reward_range: tuple[float, float] = (0.0, 1.0)

    @abc.abstractmethod
    def problems(self, seed: int) -> Iterator[Problem]:
        """An endless, deterministic stream of training problems for `seed`."""

    @abc.abstractmethod
    def eval_problems(self, n: int) -> list[Problem]:
        """The first `n` problems of the fixed held-out split."""

    @abc.abstractmethod
    def _score(self, problem: Problem, text: str) -> tuple[float, bool, dict]:
        """(reward, correct, info) of a finished completion; may raise (caught by `reward`)."""

    def demonstration(self, problem: Problem) -> str:
        """The target completion text of `problem` (without EOS) for supervised training."""
        raise NotImplementedError(f"task {self.name!r} has no demonstrations")

    def demonstrations(self, seed: int) -> Iterator[tuple[Problem, str]]:
        """(problem, target_text) pairs from the training stream of `seed`; EOS not included."""
        for problem in self.problems(seed):
            yield problem, self.demonstration(problem)

    def reward(self, problem: Problem, completion_text: str,
               finish_reason: str = "stop") -> RewardResult:
        """Scores `completion_text` (the decoded completion, EOS excluded). Never raises."""
        info: dict = {"finish_reason": str(finish_reason)[:32]}
        try:
            if finish_reason != "stop":
                info["reason"] = "truncated" if finish_reason == "length" else "unfinished"
                return RewardResult(float(self.truncated_reward), False, info)
            text = completion_text if isinstance(completion_text, str) else (
                "" if completion_text is None else str(completion_text))
            reward, correct, extra = self._score(problem, text)
            info.update(extra)
            return RewardResult(float(reward), bool(correct), info)
        except Exception as e:  # noqa: BLE001 - a verifier must never take a worker down
            info["error"] = f"{type(e).__name__}: {e}"[:300]
            return RewardResult(0.0, False, info)


class GeneratedTask(Task):
    """A task whose problems come from a seeded generator `_generate(rng)`.

    The train stream of `seed` and the single eval stream use independent generators and
    keep only prompts on their side of the hash split (see the module docstring).
    """

    @abc.abstractmethod
    def _generate(self, rng: np.random.Generator) -> tuple[str, Any, dict]:
        """One (prompt, answer, meta) drawn from the task's full problem distribution."""

    def _rng(self, stream: int, seed: int) -> np.random.Generator:
        salt = stable_hash(self.name) & 0xFFFFFFFF
        return np.random.default_rng(np.random.SeedSequence([salt, stream, seed]))

    def problems(self, seed: int) -> Iterator[Problem]:
        seed = non_negative_int(seed, "seed")
        rng, i, rejected = self._rng(_TRAIN_STREAM, seed), 0, 0
        while True:
            prompt, answer, meta = self._generate(rng)
            if is_held_out(prompt):
                rejected += 1
                if rejected > 1000 * HELD_OUT_MODULUS:  # only held-out prompts exist
                    raise ValueError(f"task {self.name!r}: the configured problem space has "
                                     "no training prompts outside the held-out split")
                continue
            yield Problem(f"{self.name}/s{seed}/i{i}", prompt, answer, meta)
            i, rejected = i + 1, 0

    def eval_problems(self, n: int) -> list[Problem]:
        n = non_negative_int(n, "n")
        rng, out = self._rng(_EVAL_STREAM, 0), []
        for _ in range(100 * HELD_OUT_MODULUS * (n + 10)):  # a tiny problem space may hold few
            if len(out) == n:
                break
            prompt, answer, meta = self._generate(rng)
            if is_held_out(prompt):
                out.append(Problem(f"{self.name}/eval/i{len(out)}", prompt, answer, meta))
        if len(out) < n:
            raise ValueError(f"task {self.name!r}: found only {len(out)} of {n} held-out problems; "
                             "the configured problem space is too small")
        return out


def nested(prefix: str, section: Any) -> dict:
    """Wraps a config section so that dotted keys like 'task.median_length' resolve in it."""
    for part in reversed(prefix.split(".")):
        section = {part: section}
    return section
