"""The environment interface: multi-turn episodes in which the model calls tools.

An episode starts from a task item (a `Problem`). Its token sequence grows turn by turn:

    prompt ids | model turn 1 | env reply 1 | model turn 2 | env reply 2 | ... | final model turn

* The **model turn** is whatever the engine sampled for the request whose prompt is the exact
  token ids of the episode so far; it ends at a stop token (EOS or one of the task's
  `turn_stop_texts`, e.g. ';' after a tool call) or at a length limit.
* The **environment** sees the finished turn (`ModelTurn`: its ids, its decoded text, which
  stop token ended it) and answers with an `EnvReply`: either text/ids to append (a tool
  result, feedback) and the next turn starts, or `done` with a reward.
* Nothing is ever re-tokenized: model tokens stay the engine's ids; an environment's text is
  encoded once with `tokenizer.encode` (no special tokens) and appended, or the environment
  gives token ids directly.

`Environment.step` runs on a tool thread, never on the engine's thread nor the runner's: it
may block (a slow tool, an HTTP call) and the runner keeps the engine busy with the other
episodes meanwhile. A step that overruns the runner's `tool_timeout_s`, raises, or returns
garbage ends its episode with a recorded reason (`pipelinerl_jax.envs.runner`).

An `EnvTask` is a `GeneratedTask` (seeded problem streams, a held-out eval split, a verifier
that never raises) that also builds one `Environment` per episode and gives multi-turn
demonstrations: `demonstration_turns(problem)` is the list of (model text, env text) pairs of
a correct episode; `encode_demonstration` turns them into the ids and loss mask the runner
would produce for the same episode (so a supervised warm start trains exactly the layout RL
samples). `reward(problem, transcript)` scores a full transcript's text (the completion after
the prompt) by its last line, which is what the environment's own final verdict uses.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from pipelinerl_jax.tasks.base import GeneratedTask, Problem


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    """A finished model turn as the environment sees it.

    `text` is `tokenizer.decode(token_ids)` (special tokens dropped; ids the tokenizer cannot
    decode are left out of the text, never out of the sequence). `stop_text` is the
    `turn_stop_texts` entry that ended the turn, `''` for EOS.
    """
    index: int  # 0-based turn number within the episode
    token_ids: np.ndarray  # int32 [k], the engine's ids of this turn
    text: str
    stop_text: str
    ended_with_eos: bool


@dataclasses.dataclass(frozen=True)
class EnvReply:
    """The environment's answer to a model turn: more context, or the end with a reward.

    Build with `EnvReply.say(text)`, `EnvReply.say_ids(ids)` or `EnvReply.finish(reward,...)`.
    A `done` reply appends nothing.
    """
    done: bool = False
    text: Optional[str] = None
    token_ids: Optional[Sequence[int]] = None
    reward: float = 0.0
    correct: bool = False
    info: dict = dataclasses.field(default_factory=dict)  # JSON-able, for logs

    @classmethod
    def say(cls, text: str) -> "EnvReply":
        return cls(text=text)

    @classmethod
    def say_ids(cls, token_ids: Sequence[int]) -> "EnvReply":
        return cls(token_ids=token_ids)

    @classmethod
    def finish(cls, reward: float, correct: bool = False, **info: Any) -> "EnvReply":
        return cls(done=True, reward=reward, correct=correct, info=info)


class Environment(abc.ABC):
    """The state of one episode; `step` is called once per stop-ended model turn, in order,
    on a tool thread (so it may block), never concurrently for one episode."""

    @abc.abstractmethod
    def step(self, turn: ModelTurn) -> EnvReply:
        """Answers `turn`: a tool result / feedback to append, or done with a reward."""


def last_line(text: str) -> str:
    """The text after the last newline, stripped: where an episode's final answer sits."""
    return text.rsplit("\n", 1)[-1].strip()


class EnvTask(GeneratedTask):
    """A task played as multi-turn episodes (see the module docstring).

    Subclasses set `turn_stop_texts` (each one token), `default_max_turns`, the `Task` size
    hints (`max_completion_tokens` bounds a whole correct transcript plus EOS) and implement
    `make_env`, `demonstration_turns` and `score_answer`.
    """

    turn_stop_texts: tuple[str, ...] = ()
    default_max_turns: int = 4

    @abc.abstractmethod
    def make_env(self, problem: Problem) -> Environment:
        """A fresh environment for one episode of `problem` (cheap; runs on the runner)."""

    @abc.abstractmethod
    def demonstration_turns(self, problem: Problem) -> list[tuple[str, str]]:
        """(model text, env text) per turn of a correct episode; the last env text is ''
        and the last model text is the final answer (EOS follows it, not included)."""

    @abc.abstractmethod
    def score_answer(self, problem: Problem, answer: str) -> tuple[float, bool, dict]:
        """(reward, correct, info) of a final answer line; may raise (callers catch)."""

    def demonstration(self, problem: Problem) -> str:
        return "".join(m + e for m, e in self.demonstration_turns(problem))

    def _score(self, problem: Problem, text: str) -> tuple[float, bool, dict]:
        return self.score_answer(problem, last_line(text))

    def stop_token_ids(self, tokenizer) -> tuple[int, ...]:
        """EOS and the ids of `turn_stop_texts` (each must encode to exactly one token)."""
        ids = [tokenizer.eos_id]
        for s in self.turn_stop_texts:
            enc = tokenizer.encode(s)
            if len(enc) != 1:
                raise ValueError(f"task {self.name!r}: turn stop text {s!r} encodes to "
                                 f"{len(enc)} tokens with {tokenizer.name}; it must be one")
            ids.append(int(enc[0]))
        return tuple(dict.fromkeys(ids))

    def stop_text_of(self, tokenizer, token_id: int) -> str:
        for s in self.turn_stop_texts:
            if tokenizer.encode(s) == [token_id]:
                return s
        return ""


def final_answer_reply(task: EnvTask, problem: Problem, turn: ModelTurn) -> EnvReply:
    """The verdict on a final (EOS-ended) turn, by the task's verifier; never raises."""
    result = task.reward(problem, turn.text, "stop")
    return EnvReply.finish(result.reward, result.correct, **result.info)


def encode_demonstration(task: EnvTask, tokenizer, problem: Problem):
    """(prompt_ids, completion_ids, loss_mask) of a demonstration, laid out as the runner lays
    out an episode: model turns (loss 1, the last one ending with EOS) and env replies (loss 0),
    each segment encoded on its own."""
    prompt = np.asarray(tokenizer.encode_prompt(problem.prompt), np.int32)
    ids, mask = [], []
    turns = task.demonstration_turns(problem)
    for i, (model_text, env_text) in enumerate(turns):
        m = tokenizer.encode(model_text) + ([tokenizer.eos_id] if i == len(turns) - 1 else [])
        e = tokenizer.encode(env_text)
        ids += m + e
        mask += [1] * len(m) + [0] * len(e)
    return prompt, np.asarray(ids, np.int32), np.asarray(mask, np.uint8)
