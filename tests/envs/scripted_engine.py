"""A scripted `InferenceEngine` written from the contract in `rollout/engine.py`.

`policy(request, sample_index) -> list of token ids` says what the "model" would generate;
generation ends at the first stop id (finish reason 'stop'), else at `max_new_tokens` or the
context (`'length'`), as `JaxEngine` does. `delay(request) -> seconds` says when the sample is
finished: `get_completions` returns samples in finishing order once their time has come, so
tests control which episode finishes first without a model.

Provenance mimics an in-flight weight update: the first half of a sample's tokens carry the
version live at submit, the rest the version live when it is returned (`kv_version` = the
submit version, the 'keep' policy). Log-probs are a fixed function of (position, token).
`submitted` and `returned` record everything, so tests compare the runner's output with
exactly what the engine saw and produced. Blocking `generate` is the base class's.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional

import numpy as np

from pipelinerl_jax.rollout.engine import (EngineClosedError, InferenceEngine, RequestError,
                                           validate_request)
from pipelinerl_jax.records import Completion


def fake_logp(position: int, token: int) -> float:
    return -0.01 * (position + 1) - 0.001 * token


class ScriptedEngine(InferenceEngine):
    def __init__(self, policy: Callable, *, delay: Callable | float = 0.0, vocab_size: int = 64,
                 max_seq_len: int = 256, version: int = 0, engine_id: str = "scripted"):
        self.policy, self.vocab_size, self.max_seq_len = policy, vocab_size, max_seq_len
        self._delay = delay if callable(delay) else (lambda req: float(delay))
        self._version, self.engine_id = version, engine_id
        self._cv = threading.Condition()
        # (ready_at, seq, request, index, submit_version, submit_time, forced finish reason)
        self._pending: list = []
        self._seq = 0
        self._live: dict = {}
        self._closed = self._paused = False
        self.submitted: list = []
        self.returned: List[Completion] = []
        self.aborted: list = []

    @property
    def version(self) -> int:
        return self._version

    def submit(self, request) -> None:
        validate_request(request, self.vocab_size, self.max_seq_len)
        with self._cv:
            if self._closed:
                raise EngineClosedError("closed")
            if request.request_id in self._live:
                raise RequestError(f"request {request.request_id!r}: already in flight")
            self.submitted.append(request)
            ready = time.monotonic() + self._delay(request)
            for i in range(request.params.n):
                self._pending.append((ready, self._seq, request, i, self._version, time.time(),
                                      None))
                self._seq += 1
            self._live[request.request_id] = request.params.n
            self._cv.notify_all()

    def _complete(self, entry) -> Completion:
        _, _, req, i, v0, t0, reason = entry
        prompt = np.asarray(req.prompt_ids, np.int32)
        room = min(req.params.max_new_tokens, self.max_seq_len - len(prompt))
        toks, stops = [], set(req.params.stop_token_ids)
        if reason is None:
            reason = "length"
            for t in list(self.policy(req, i))[:room]:
                toks.append(int(t))
                if t in stops:
                    reason = "stop"
                    break
        k = len(toks)
        version = np.asarray([v0] * (k // 2) + [self._version] * (k - k // 2), np.int32)
        c = Completion(
            request_id=req.request_id, sample_index=i, prompt_ids=prompt,
            token_ids=np.asarray(toks, np.int32),
            logp_behaviour=np.asarray([fake_logp(len(prompt) + j, t) for j, t in enumerate(toks)],
                                      np.float32),
            version=version, kv_version=np.full(k, v0, np.int32), finish_reason=reason,
            start_version=v0, engine_id=self.engine_id, submit_time=t0, start_time=t0,
            finish_time=time.time())
        self._live[req.request_id] -= 1
        if not self._live[req.request_id]:
            del self._live[req.request_id]
        self.returned.append(c)
        return c

    def get_completions(self, timeout: Optional[float] = 0.0, max_items=None, *,
                        request_ids=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                now = time.monotonic()
                ready = sorted(e for e in self._pending if e[0] <= now and (
                    request_ids is None or e[2].request_id in request_ids))[:max_items]
                if ready and not self._paused:
                    for e in ready:
                        self._pending.remove(e)
                    return [self._complete(e) for e in ready]
                nxt = min((e[0] for e in self._pending), default=None)
                left = None if deadline is None else deadline - now
                if (left is not None and left <= 0) or self._closed:
                    return []
                waits = [x for x in (left, None if nxt is None else nxt - now) if x is not None]
                self._cv.wait(max(0.0, min(waits)) if waits else None)

    def update_weights(self, weights, version, *, wait=True, timeout=None, allow_older=False):
        with self._cv:
            if version <= self._version and not allow_older:
                raise ValueError(f"version {version} is not newer than {self._version}")
            self._version = int(version)

    def pause(self):
        self._paused = True

    def resume(self):
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def abort(self, request_id: str) -> int:
        with self._cv:
            mine = [e for e in self._pending if e[2].request_id == request_id]
            for e in mine:  # returned at once, as 'abort' completions without tokens
                self._pending.remove(e)
                self._pending.append((0.0, *e[1:6], "abort"))
            if mine:
                self.aborted.append(request_id)
                self._cv.notify_all()
            return len(mine)

    def release(self, which: Callable) -> int:
        """Makes the pending samples of requests `which(request)` finish now."""
        with self._cv:
            now = time.monotonic()
            mine = [e for e in self._pending if which(e[2])]
            for e in mine:
                self._pending.remove(e)
                self._pending.append((now, *e[1:]))
            self._cv.notify_all()
            return len(mine)

    def health(self):
        return {"ok": not self._closed, "version": self._version, "running": True,
                "paused": self._paused, "error": None, "closed": self._closed}

    def stats(self):
        # The fields every engine reports (engine.stats); a scripted engine has no windows.
        return {"engine_id": self.engine_id, "version": self._version, "num_slots": 0,
                "slot_occupancy": 0.0, "busy_fraction": 0.0, "window_s": 0.0,
                "window_decode_steps": 0, "tokens_per_s": 0.0, "queued_samples": 0}

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()
