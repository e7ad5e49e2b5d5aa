"""Where environment steps run: a pool of daemon threads, and the checks on what they return.

Python cannot kill a thread, so a tool that hangs keeps its thread. The runner gives up on it
at its timeout, counted from when the call started running (`ToolPool.started`), and calls
`ToolPool.abandon`: a call still queued is cancelled; a running one's thread is written off
and a replacement started, so one stuck tool never starves the others (up to `max_abandoned`
stuck threads at once; past that `live_threads` shrinks). Threads are daemons: a stuck tool
never keeps the process from exiting (`concurrent.futures.ThreadPoolExecutor` joins its
threads at exit).
A tool that must be stopped for real (a subprocess, a sandbox) should enforce its own
deadline; the runner's timeout is the backstop.

`run_step` is what a pool thread runs for one model turn: decode the turn, call
`env.step`, and turn the reply into appended ids or a verdict — or raise `StepRaised` /
`EnvGarbage`, which the runner records as the episode's end reason.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from pipelinerl_jax.envs.base import EnvReply, ModelTurn

MAX_REWARD = 1e6  # |reward| above this is garbage, not a reward


class StepRaised(Exception):
    """`env.step` raised (the original is the `__cause__`)."""


class EnvGarbage(Exception):
    """`env.step` returned something that is not a usable reply; the message says what."""


class StepResult(NamedTuple):
    ids: Optional[np.ndarray]  # int32 [k] to append (None when done)
    done: bool
    reward: float
    correct: bool
    info: dict


class ToolPool:
    """Daemon worker threads with give-up-able calls (module docstring)."""

    def __init__(self, num_threads: int = 16, max_abandoned: int = 64, name: str = "tool"):
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads, self.max_abandoned, self.name = num_threads, max_abandoned, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict = {}  # Future -> (thread running it, monotonic start time)
        self._retired: set = set()  # threads written off (their call was abandoned)
        self._threads: set = set()
        self._closed = False
        self.abandoned_total = 0
        for _ in range(num_threads):
            self._spawn()

    def _spawn(self) -> None:
        t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}",
                             daemon=True)
        self._threads.add(t)
        t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[fut] = (me, time.monotonic())
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - even SystemExit from a tool is its failure
                fut.set_exception(e)
            else:
                fut.set_result(result)
            with self._lock:
                self._running.pop(fut, None)
                if me in self._retired:  # a replacement took this thread's place
                    self._retired.discard(me)
                    self._threads.discard(me)
                    return

    def submit(self, fn: Callable, *args: Any) -> Future:
        if self._closed:
            raise RuntimeError(f"tool pool {self.name!r} is closed")
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def abandon(self, fut: Future) -> bool:
        """Gives up on `fut`; returns True when a running thread was written off."""
        if fut.cancel() or fut.done():
            return False
        with self._lock:
            thread = self._running.get(fut, (None,))[0]
            if thread is None or thread in self._retired:
                return False
            self._retired.add(thread)
            self.abandoned_total += 1
            if len(self._retired) <= self.max_abandoned and not self._closed:
                self._spawn()
            return True

    def started(self, fut: Future) -> Optional[float]:
        """`time.monotonic()` when `fut` started running; None while queued or once done."""
        with self._lock:
            return self._running.get(fut, (None, None))[1]

    @property
    def live_threads(self) -> int:
        """Threads that take new calls (not written off)."""
        with self._lock:
            return len(self._threads) - len(self._retired)

    @property
    def stuck(self) -> int:
        """Threads currently written off and still inside a tool call."""
        with self._lock:
            return len(self._retired)

    def close(self) -> None:
        """Stops idle threads; stuck ones are daemons and are left behind."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = len(self._threads)
        for _ in range(n):
            self._jobs.put(None)


def decode_turn(tokenizer, ids: np.ndarray) -> str:
    """Text of a model turn; ids the tokenizer cannot decode are left out of the text."""
    try:
        return tokenizer.decode(ids)
    except Exception:  # noqa: BLE001 - an engine vocabulary larger than the tokenizer's
        ok = [int(i) for i in ids if 0 <= int(i) < tokenizer.vocab_size]
        try:
            return tokenizer.decode(ok)
        except Exception:  # noqa: BLE001
            return ""


def run_step(env, turn_ids: np.ndarray, index: int, stop_text: str, eos_id: int, tokenizer,
             max_env_tokens: int) -> StepResult:
    """Runs one environment step on a pool thread and checks its reply (module docstring)."""
    turn = ModelTurn(index=index, token_ids=turn_ids, text=decode_turn(tokenizer, turn_ids),
                     stop_text=stop_text, ended_with_eos=bool(len(turn_ids))
                     and int(turn_ids[-1]) == eos_id)
    try:
        reply = env.step(turn)
    except Exception as e:  # noqa: BLE001 - a tool bug ends the episode, not the runner
        raise StepRaised(f"{type(e).__name__}: {e}"[:300]) from e
    return check_reply(reply, tokenizer, max_env_tokens)


def check_reply(reply: Any, tokenizer, max_env_tokens: int) -> StepResult:
    """Validates an `EnvReply` and encodes its text; raises `EnvGarbage` saying what is wrong."""
    if not isinstance(reply, EnvReply):
        raise EnvGarbage(f"step returned {type(reply).__name__}, not an EnvReply")
    if reply.done:
        r = reply.reward
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, float, np.integer,
                                                                  np.floating)):
            raise EnvGarbage(f"reward must be a number, got {type(r).__name__}")
        if not math.isfinite(float(r)) or abs(float(r)) > MAX_REWARD:
            raise EnvGarbage(f"reward {float(r)!r} is not finite or exceeds {MAX_REWARD:g}")
        info = reply.info if isinstance(reply.info, dict) else {}
        return StepResult(None, True, float(r), bool(reply.correct), info)
    if (reply.text is None) == (reply.token_ids is None):
        raise EnvGarbage("a reply that is not done needs exactly one of text / token_ids")
    if reply.text is not None:
        if not isinstance(reply.text, str):
            raise EnvGarbage(f"text must be a str, got {type(reply.text).__name__}")
        # Any tokenizer spends >= 1 char per token on ordinary text: refuse before encoding.
        if len(reply.text) > 64 * max_env_tokens:
            raise EnvGarbage(f"text of {len(reply.text)} chars is far over max_env_tokens="
                             f"{max_env_tokens}")
        try:
            ids = np.asarray(tokenizer.encode(reply.text), np.int64)
        except Exception as e:  # noqa: BLE001 - e.g. a character outside the vocabulary
            raise EnvGarbage(f"text cannot be encoded: {e}"[:300]) from None
    else:
        try:
            ids = np.asarray(reply.token_ids)
        except Exception as e:  # noqa: BLE001 - ragged or exotic objects
            raise EnvGarbage(f"token_ids is not an array of ids: {e}"[:300]) from None
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise EnvGarbage(f"token_ids must be a 1-d sequence of integers, got dtype "
                             f"{ids.dtype} shape {ids.shape}")
    if ids.size > max_env_tokens:
        raise EnvGarbage(f"reply of {ids.size} tokens exceeds max_env_tokens={max_env_tokens}")
    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise EnvGarbage(f"token id {bad} is outside the tokenizer's vocabulary "
                         f"[0, {tokenizer.vocab_size})")
    return StepResult(ids.astype(np.int32), False, 0.0, False, {})
