"""The `InferenceEngine` interface every sampler implements (embedded JAX, SGLang over HTTP).

A rollout worker and the learner only ever see this interface (Tunix's rollout pattern):

    engine.submit(request)                       # non-blocking; bad requests raise RequestError
    engine.get_completions(timeout=0.1)          # finished samples, in finishing order
    engine.update_weights(weights, version)      # in-flight, atomic, versions strictly increase
    engine.generate(requests)                    # blocking convenience (tests, sync mode)

Requests are `GenerationRequest`s; each of their `params.n` samples comes back as its own
`Completion` (see `pipelinerl_jax.records` and DESIGN.md "Provenance" for the per-token fields),
as soon as it finishes, independently of the other samples of the request. Nothing here
assumes a transport: an HTTP engine implements the same methods over its client.

Request validation (`validate_request`) is shared so that every engine rejects the same
inputs with the same messages, each naming the offending field; so are the blocking
`generate` (written once, here, over `submit_batch` + `get_completions`) and the assembly of
a `Completion` from the chunks a sample was generated in (`completion_from_chunks`).
"""
from __future__ import annotations

import abc
import collections
import math
import time
from typing import AbstractSet, Any, Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.records import Completion, GenerationRequest


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the request and the field.

    `request_id` is set when the failure belongs to one submitted request (its samples will
    not come back), so a caller can forget that request and carry on.
    """

    def __init__(self, message: str, request_id: Optional[str] = None):
        super().__init__(message)
        self.request_id = request_id


class EngineClosedError(RuntimeError):
    """The engine was closed (or its loop died); it accepts no more work."""


def validate_request(request: GenerationRequest, vocab_size: int, max_seq_len: int,
                     max_stop_tokens: Optional[int] = None) -> np.ndarray:
    """Checks a request; returns its prompt as int32 `[P]` or raises `RequestError`.

    A prompt must leave room for at least one new token (`P <= max_seq_len - 1`); a
    `max_new_tokens` that overruns the context is allowed and ends with finish reason
    'length' when the context is full.
    """
    rid = getattr(request, "request_id", None)

    def bad(field, msg):
        raise RequestError(f"request {rid!r}: {field}: {msg}")

    if not isinstance(request, GenerationRequest):
        raise RequestError(f"expected a GenerationRequest, got {type(request).__name__}")
    if not isinstance(rid, str) or not rid:
        bad("request_id", "must be a non-empty string")
    try:
        prompt = np.asarray(request.prompt_ids)
    except Exception as e:  # noqa: BLE001 - any unconvertible input is the caller's error
        bad("prompt_ids", f"not an array of token ids ({e})")
    if prompt.ndim != 1:
        bad("prompt_ids", f"must be 1-D, got shape {prompt.shape}")
    if prompt.size == 0:
        bad("prompt_ids", "is empty (a prompt needs at least one token)")
    if not np.issubdtype(prompt.dtype, np.integer):
        bad("prompt_ids", f"must hold integer token ids, got dtype {prompt.dtype}")
    if prompt.size > max_seq_len - 1:
        bad("prompt_ids", f"length {prompt.size} leaves no room for a new token in the "
                          f"context of {max_seq_len} tokens (max prompt {max_seq_len - 1})")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab_size:
        bad("prompt_ids", f"token id {lo if lo < 0 else hi} outside the vocabulary "
                          f"[0, {vocab_size})")
    p = request.params
    if isinstance(p.max_new_tokens, bool) or not isinstance(p.max_new_tokens, (int, np.integer)) \
            or p.max_new_tokens <= 0:
        bad("params.max_new_tokens", f"must be a positive integer, got {p.max_new_tokens!r}")
    if isinstance(p.n, bool) or not isinstance(p.n, (int, np.integer)) or p.n <= 0:
        bad("params.n", f"must be a positive integer, got {p.n!r}")
    if not _finite(p.temperature) or p.temperature < 0:
        bad("params.temperature", f"must be a finite number >= 0 (0 = greedy), "
                                  f"got {p.temperature!r}")
    if not _finite(p.top_p) or not 0 < p.top_p <= 1:
        bad("params.top_p", f"must be in (0, 1], got {p.top_p!r}")
    if isinstance(p.top_k, bool) or not isinstance(p.top_k, (int, np.integer)) or p.top_k < 0:
        bad("params.top_k", f"must be an integer >= 0 (0 = off), got {p.top_k!r}")
    stops = list(p.stop_token_ids or ())
    for s in stops:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < vocab_size:
            bad("params.stop_token_ids", f"{s!r} is not a token id in [0, {vocab_size})")
    if max_stop_tokens is not None and len(set(stops)) > max_stop_tokens:
        bad("params.stop_token_ids", f"{len(set(stops))} stop ids; this engine takes at most "
                                     f"{max_stop_tokens} (engine.max_stop_tokens)")
    if p.seed is not None and (isinstance(p.seed, bool)
                               or not isinstance(p.seed, (int, np.integer))):
        bad("params.seed", f"must be an integer or None, got {p.seed!r}")
    return prompt.astype(np.int32)


def completion_from_chunks(request: GenerationRequest, sample_index: int, prompt: np.ndarray,
                           tokens: Sequence, logps: Sequence, versions: Sequence,
                           kv_versions: Sequence, *, finish_reason: str, start_version: int,
                           engine_id: str, submit_time: float, start_time: float) -> Completion:
    """The `Completion` of a sample generated in chunks (per-chunk arrays of tokens,
    log-probs, versions and KV versions, concatenated here; none for a sample that produced
    nothing), finished now."""
    def cat(xs, dt):
        return np.concatenate(xs).astype(dt) if xs else np.zeros((0,), dt)
    return Completion(
        request_id=request.request_id, sample_index=sample_index, prompt_ids=prompt,
        token_ids=cat(tokens, np.int32), logp_behaviour=cat(logps, np.float32),
        version=cat(versions, np.int32), kv_version=cat(kv_versions, np.int32),
        finish_reason=finish_reason, start_version=int(start_version), engine_id=engine_id,
        submit_time=submit_time, start_time=start_time, finish_time=time.time())


def has_ready(outbox: collections.deque, request_ids: Optional[AbstractSet[str]]) -> bool:
    """Whether `outbox` holds a finished sample (of `request_ids` only, when given)."""
    return bool(outbox) if request_ids is None else any(
        c.request_id in request_ids for c in outbox)


def take_ready(outbox: collections.deque, request_ids: Optional[AbstractSet[str]],
               max_items: Optional[int]) -> List[Completion]:
    """Removes and returns the finished samples of `outbox` (of `request_ids` only, when
    given; the others stay, in order), oldest first, at most `max_items`. The engines'
    `get_completions` share it, under their own locks."""
    if request_ids is None:
        n = len(outbox) if max_items is None else min(max_items, len(outbox))
        return [outbox.popleft() for _ in range(n)]
    mine, rest = [], []
    for c in outbox:
        wanted = c.request_id in request_ids and (max_items is None or len(mine) < max_items)
        (mine if wanted else rest).append(c)
    outbox.clear()
    outbox.extend(rest)
    return mine


def check_version_order(version: int, newest: int, live: int, allow_older: bool) -> None:
    """`update_weights`' ordering rule: unless `allow_older`, `version` must exceed `newest`
    (the newest version accepted, live or pending; `live` is the one in use)."""
    if not allow_older and version <= newest:
        raise ValueError(
            f"update_weights: version {version} is not newer than the engine's version "
            f"{newest} (live {live}); versions must strictly increase, a stale or duplicate "
            "update is never applied")


def _finite(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) \
        and math.isfinite(x)


class InferenceEngine(abc.ABC):
    """A sampler that serves generation requests and takes versioned weight updates."""

    engine_id: str = ""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weight version the next forward pass uses."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> None:
        """Queues a request (non-blocking). Raises `RequestError` for a bad request (the
        engine keeps serving the others) and `EngineClosedError` after `close()`."""

    def submit_batch(self, requests: Sequence[GenerationRequest]) -> None:
        """Queues several requests as one arrival. An engine whose scheduling depends on what
        has arrived when it looks (`JaxEngine`) takes them all at once, so the batches it
        forms do not depend on thread timing; this default submits them one by one."""
        for r in requests:
            self.submit(r)

    @abc.abstractmethod
    def get_completions(self, timeout: Optional[float] = 0.0,
                        max_items: Optional[int] = None, *,
                        request_ids: Optional[AbstractSet[str]] = None) -> List[Completion]:
        """Finished samples in finishing order. Waits up to `timeout` seconds (None = until
        at least one is ready) and returns [] when none finished in time, or once the engine
        has stopped. A request the engine failed raises `RequestError` (with its
        `request_id`). With `request_ids`, only those requests' samples and failures: the
        others stay queued for the next caller."""

    def generate(self, requests: Sequence[GenerationRequest],
                 timeout: Optional[float] = None) -> List[Completion]:
        """Submits `requests` (all or nothing, one arrival: `submit_batch`) and blocks until
        all their samples finished; returns them in request order, then sample order. Other
        requests' completions stay queued for `get_completions`. Raises `RequestError` when
        the engine fails one of the requests, `TimeoutError` after `timeout` seconds, and
        `EngineClosedError` when the engine stops first."""
        requests = list(requests)
        self.submit_batch(requests)
        order = {r.request_id: i for i, r in enumerate(requests)}
        total = sum(int(r.params.n) for r in requests)
        got: Dict[tuple, Completion] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = 0.0
        while True:
            for c in self.get_completions(wait, request_ids=order.keys()):
                got[(c.request_id, c.sample_index)] = c
            if len(got) >= total:
                break
            stopped = self._stopped()
            if stopped is not None:
                raise EngineClosedError(f"engine stopped during generate: {stopped}")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"generate: {total - len(got)} samples unfinished after "
                                   f"{timeout}s")
            # An engine without a serving loop is driven from here, one step at a time.
            wait = 0.0 if self._drive() else (1.0 if left is None else min(left, 1.0))
        return sorted(got.values(), key=lambda c: (order[c.request_id], c.sample_index))

    def _drive(self) -> bool:
        """`generate`'s hook for engines that serve only when driven: runs one scheduling
        step and returns True; False (the default) when a loop or a server does the work."""
        return False

    def _stopped(self) -> Optional[str]:
        """`generate`'s hook: why the engine can no longer finish requests (closed, its loop
        died), or None while it can. Default: from `health()`."""
        h = self.health()
        return ("closed" if h.get("closed") else None)

    @abc.abstractmethod
    def update_weights(self, weights: Any, version: int, *, wait: bool = True,
                       timeout: Optional[float] = None, allow_older: bool = False) -> None:
        """Installs new weights as `version` between two forward passes, without dropping
        in-flight requests. `weights` is a flat `{state path: array}` dict
        (`pipelinerl_jax.models.flat_params`), an `nnx.State`, a model, or the path of an HF
        checkpoint directory. `version` must exceed every version seen so far (unless
        `allow_older`, which lag injection uses to install an older version on purpose), else
        `ValueError` naming both. With `wait`, returns once the version is live."""

    def weight_shapes(self) -> Optional[Dict[str, tuple]]:
        """`{name: shape}` of the flat weights `update_weights` takes, for engines that take
        arrays: a weight subscriber refuses a version with other names or shapes before
        allocating anything for it. None (the default): no such expectation (e.g. weights
        that arrive as an HF directory)."""
        return None

    @abc.abstractmethod
    def pause(self) -> None:
        """Stops generating after the current step (requests stay queued / in flight)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Undoes `pause()`."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> int:
        """Ends a request's queued and running samples with finish reason 'abort'; returns
        how many samples were aborted."""

    @abc.abstractmethod
    def health(self) -> Dict[str, Any]:
        """`{'ok': bool, 'version': int, 'running': bool, 'paused': bool, 'error': str|None}`."""

    @abc.abstractmethod
    def stats(self) -> Dict[str, Any]:
        """Load figures; rates and occupancies are averages since the previous call."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops serving; unfinished samples come back with finish reason 'abort'."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
