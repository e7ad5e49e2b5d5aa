"""`JaxEngine`: the embedded sampler — continuous batching over a dense KV cache, in JAX.

Scheduling: each `step()` applies a pending weight update, admits queued samples into free
slots while the KV budget allows (batched prefill), and runs one decode chunk of up to
`steps_per_sync` steps on device; see `jax_scheduler.py`. A sample is one of the `n` samples
of a request; each finishes and is returned on its own.

Provenance (DESIGN.md): a token gets `version` = the version live when the forward pass that
sampled it ran, and `kv_version` = the oldest version that wrote the KV it attended to; the
engine tracks, per sample, the version of its oldest KV write (its admission version under
'keep', reset to the new version by a 'recompute' re-prefill). Log-probs: see
`pipelinerl_jax.rollout.sampling` (`engine.logprob_mode`).

The physical cache is dense (`max_slots × max_seq_len`); `kv_budget_tokens` is the admission
limit that models HBM on an accelerator (how many tokens of KV the device could hold).

`engine_config` / `validate_engine_config` own the run config's `engine` section and
`make_jax_engine` builds a rollout worker's engine: the 'jax' row of `rollout/factory.py`.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pipelinerl_jax import config as cfg_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models import Decoder, flat_params, from_pretrained
from pipelinerl_jax.models.config import dtype_of
from pipelinerl_jax.rollout import engine_memory, engine_steps
from pipelinerl_jax.rollout.decode_step import init_engine_cache
from pipelinerl_jax.rollout.engine import (EngineClosedError, InferenceEngine, RequestError,
                                           validate_request)
from pipelinerl_jax.rollout.jax_scheduler import Sample, SlotScheduler, buckets
from pipelinerl_jax.rollout.sampling import LOGPROB_MODES
from pipelinerl_jax.types import Completion, GenerationRequest

KV_POLICIES = ("keep", "recompute")
DTYPES = ("float32", "bfloat16")


def engine_config() -> ml_collections.ConfigDict:
    """Defaults of the `engine` config section (every key is validated by the function below)."""
    c = ml_collections.ConfigDict()
    c.max_slots = 8  # concurrent samples (decode batch rows)
    c.max_seq_len = 256  # context: prompt + generated tokens
    c.kv_budget_tokens = 0  # KV tokens admitted samples may reserve; 0 = max_slots * max_seq_len
    c.prefill_buckets = ()  # prompt-length buckets; () = 16, 32, ... up to max_seq_len
    c.cache_buckets = ()  # attention-length buckets of decode; () = 64, 128, ... max_seq_len
    c.max_prefill_batch = 4  # prompts per prefill call (batch buckets: powers of two up to it)
    c.steps_per_sync = 16  # decode steps per device call / host sync
    # While samples wait, a decode chunk ends once this many slots are free (then they are
    # refilled with one batched prefill); 0 = auto: min(queued, max(1, max_slots // 8)).
    c.refill_threshold = 0
    c.kv_policy = "keep"  # 'keep' (PipelineRL) | 'recompute' (AReaL) on a weight update
    c.logprob_mode = "sampled"  # 'sampled' (truncated, renormalised) | 'tempered'
    c.dtype = "float32"  # parameter and compute dtype of the engine's copy of the model
    c.max_stop_tokens = 8  # stop ids per request
    c.seed = 0  # seeds the per-request seeds of requests that give none
    return c


def validate_engine_config(cfg, prefix: str = "engine") -> None:
    """Raises `ConfigError` naming the first bad key of the `engine` section."""
    k = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    root = cfg
    for part in reversed(prefix.split(".") if prefix else []):
        root = {part: root}  # so the helpers can read `prefix.key` from the section alone
    cfg_lib.check_keys(cfg, prefix, engine_config().keys())
    for name in ("max_slots", "max_seq_len", "max_prefill_batch", "steps_per_sync",
                 "max_stop_tokens"):
        cfg_lib.positive_int(root, k(name))
    cfg_lib.positive_int(root, k("kv_budget_tokens"), allow_zero=True)
    cfg_lib.positive_int(root, k("refill_threshold"), allow_zero=True)
    cfg_lib.positive_int(root, k("seed"), allow_zero=True)
    max_seq_len = cfg["max_seq_len"]
    if max_seq_len < 2:
        raise cfg_lib.ConfigError(k("max_seq_len"), f"must be >= 2, got {max_seq_len}")
    for name in ("prefill_buckets", "cache_buckets"):
        b = cfg[name]
        if not isinstance(b, (tuple, list)) or any(
                isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in b):
            raise cfg_lib.ConfigError(k(name), f"must be a tuple of positive integers, got {b!r}")
        if list(b) != sorted(set(b)):
            raise cfg_lib.ConfigError(k(name), f"must be strictly increasing, got {tuple(b)}")
        if b and b[-1] > max_seq_len:
            raise cfg_lib.ConfigError(k(name), f"bucket {b[-1]} exceeds max_seq_len "
                                               f"{max_seq_len}")
    if 0 < cfg["kv_budget_tokens"] < 2:
        raise cfg_lib.ConfigError(k("kv_budget_tokens"), "must be 0 (unlimited) or >= 2")
    cfg_lib.one_of(root, k("kv_policy"), KV_POLICIES)
    cfg_lib.one_of(root, k("logprob_mode"), LOGPROB_MODES)
    cfg_lib.one_of(root, k("dtype"), DTYPES)


def validate_run_config(cfg, selected: bool) -> None:
    """The `engine` section of run config `cfg` (the 'jax' row's check), whatever
    `sampler.kind` is, so a switch of kind finds no surprise."""
    validate_engine_config(cfg.engine, "engine")


class JaxEngine(SlotScheduler, InferenceEngine):
    """Continuous-batching JAX sampler with in-flight weight updates (module docstring).

    `model` is a `Decoder` (its weights are copied) or an HF checkpoint directory; `config`
    overrides `engine_config()` (a dict or ConfigDict); `version` is the version of the
    initial weights; `mesh` places the parameters by the logical-axis rules (default: one
    device). Without `start()` the caller drives the engine with `step()` (deterministic
    tests); with `start()` (or `start=True`) a background thread does, and every public
    method is thread-safe.
    """

    def __init__(self, model: Any, config: Optional[Mapping] = None, *, version: int = 0,
                 engine_id: str = "jax-engine", mesh=None, start: bool = False):
        cfg = engine_config()
        if config is not None:
            cfg.update(config)
        validate_engine_config(cfg)
        self.config = cfg
        self.engine_id = engine_id
        self._dtype = dtype_of(cfg.dtype)
        if isinstance(model, (str, os.PathLike)):
            model = from_pretrained(os.fspath(model), dtype=self._dtype)
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a Decoder or a checkpoint path, got {type(model)}")
        self.model_config = model.cfg.replace(dtype=self._dtype, param_dtype=self._dtype)
        if cfg.max_seq_len > self.model_config.max_position_embeddings:
            raise cfg_lib.ConfigError(
                "engine.max_seq_len", f"{cfg.max_seq_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}")
        self.num_slots = cfg.max_slots
        self.max_seq_len = cfg.max_seq_len
        self.kv_budget = cfg.kv_budget_tokens or cfg.max_slots * cfg.max_seq_len
        self.prefill_buckets = buckets(cfg.prefill_buckets, 16, cfg.max_seq_len)
        self.cache_buckets = buckets(cfg.cache_buckets, 64, cfg.max_seq_len)
        self.batch_buckets = buckets((), 1, cfg.max_prefill_batch)
        # Hot-path settings as plain attributes (ConfigDict lookups are slow).
        self._steps = cfg.steps_per_sync
        self._refill = cfg.refill_threshold or max(1, cfg.max_slots // 8)
        self._max_stops = cfg.max_stop_tokens

        # ---- device state: parameters, KV cache, per-slot state
        self._mesh = mesh if mesh is not None else sharding_lib.make_mesh((1, 1, 1))
        self.memory = engine_memory.check_fits(  # before allocating: a clear error, no OOM
            self.model_config, cfg.max_slots, cfg.max_seq_len, self._dtype,
            list(self._mesh.devices.flat))
        abstract = nnx.eval_shape(lambda: Decoder(self.model_config, nnx.Rngs(0)))
        self._abstract_state = nnx.split(abstract)[1]
        self._param_shardings = sharding_lib.state_shardings(self._abstract_state, self._mesh)
        self._replicated = NamedSharding(self._mesh, P())
        cache_sharding = NamedSharding(  # engine layout: [slots, kv heads, ...]
            self._mesh, sharding_lib.logical_to_spec((None, "kv_heads", None, None)))
        self._fns = engine_steps.step_fns(self.model_config, cfg.max_seq_len, cfg.steps_per_sync,
                                          cfg.logprob_mode, cache_sharding, self._replicated)
        self._params = self._materialise(model)
        self._cache = jax.device_put(init_engine_cache(self.model_config, cfg.max_slots,
                                                       cfg.max_seq_len), cache_sharding)
        self._slots_dev = jax.device_put(
            engine_steps.empty_slots(cfg.max_slots, cfg.max_stop_tokens), self._replicated)

        # ---- host state (guarded by _lock; device work is serialised by _step_mutex)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._step_mutex = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._slots: List[Optional[Sample]] = [None] * cfg.max_slots
        self._outbox: collections.deque = collections.deque()
        self._live: Dict[str, int] = {}  # request id -> samples not yet returned
        self._version = int(version)
        self._newest_version = int(version)  # newest version accepted (live or pending)
        self._pending = None  # (params, version) waiting for the next step boundary
        self._reserved = 0
        self._paused = False
        self._closed = False
        self._error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._seed_counter = 0
        self._counters = collections.Counter()
        self._window = collections.Counter()
        self._window_start = time.perf_counter()
        if start:
            self.start()

    # ------------------------------------------------------------------ weights

    def _materialise(self, weights: Any) -> nnx.State:
        """A fresh parameter state in the engine's dtype and shardings (never aliasing the
        caller's buffers, which a learner may donate right after handing them over)."""
        if isinstance(weights, (str, os.PathLike)):
            weights = from_pretrained(os.fspath(weights), dtype=self._dtype)
        if isinstance(weights, (nnx.Module, nnx.State)):
            flat = flat_params(weights, host=False)
        elif isinstance(weights, Mapping):
            flat = weights
        else:
            raise TypeError("weights must be a flat {path: array} dict, an nnx.State, a model "
                            f"or a checkpoint path, got {type(weights).__name__}")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(
            self._abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        shardings = jax.tree_util.tree_leaves(
            self._param_shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
        names = [sharding_lib.path_name(p) for p, _ in leaves]
        missing = [n for n in names if n not in flat]
        extra = sorted(set(flat) - set(names))
        if missing or extra:
            raise ValueError(f"weights do not match the engine's model: missing {missing[:5]}, "
                             f"unknown {extra[:5]}")
        values = []
        for name, (_, var), svar in zip(names, leaves, shardings):
            arr = flat[name]
            if tuple(arr.shape) != tuple(var.shape):
                raise ValueError(f"weights: parameter {name!r} has shape {tuple(arr.shape)}, "
                                 f"the engine's model needs {tuple(var.shape)}")
            if isinstance(arr, jax.Array):
                arr = jnp.array(arr, dtype=self._dtype, copy=True)
            else:
                arr = np.asarray(arr).astype(self._dtype)
            values.append(var.replace(jax.device_put(arr, svar.get_value())))
        return jax.tree_util.tree_unflatten(treedef, values)

    def weight_shapes(self) -> Dict[str, tuple]:
        leaves = jax.tree_util.tree_flatten_with_path(
            self._abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        return {sharding_lib.path_name(p): tuple(var.shape) for p, var in leaves}

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, weights: Any, version: int, *, wait: bool = True,
                       timeout: Optional[float] = None, allow_older: bool = False) -> None:
        """See `InferenceEngine.update_weights`. `allow_older` lets lag injection install an
        older version on purpose (never used by a normal run)."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"update_weights: version must be an integer, got {version!r}")
        version = int(version)
        self._check_newer(version, allow_older)
        params = self._materialise(weights)  # the slow part, outside every lock
        with self._cv:
            self._check_newer(version, allow_older)
            self._pending = (params, version)
            self._newest_version = version
            self._cv.notify_all()
        if self._thread is None:
            with self._step_mutex:
                self._apply_pending_update()
            return
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cv:
                def live():  # (an older version on purpose is live when it is *the* version)
                    return self._version == version if allow_older else self._version >= version

                while not live() and self._error is None and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"update_weights: version {version} not live after "
                                           f"{timeout}s (engine at {self._version})")
                    self._cv.wait(left)
                if not live():
                    raise EngineClosedError(f"engine stopped before version {version} went "
                                            f"live: {self._error or 'closed'}")

    def _check_newer(self, version: int, allow_older: bool = False) -> None:
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        if not allow_older and version <= self._newest_version:
            raise ValueError(
                f"update_weights: version {version} is not newer than the engine's version "
                f"{self._newest_version} (live {self._version}); versions must strictly "
                "increase, a stale or duplicate update is never applied")


    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest) -> None:
        self.submit_batch([request])

    def submit_batch(self, requests: Sequence[GenerationRequest]) -> None:
        """Queues `requests` in one step of the queue (all or nothing: every request is
        checked first). The loop thread sees none of them or all of them, so an idle engine
        handed a whole batch schedules it the same way whatever the thread timing: admission
        order, prefill batches, slots and decode chunks, and with them every bit of the
        tokens and log-probs, are a function of the batch (lock-step runs rely on this)."""
        checked = []
        for request in requests:
            prompt = validate_request(request, self.model_config.vocab_size, self.max_seq_len,
                                      self._max_stops)
            limit = min(len(prompt) + int(request.params.max_new_tokens), self.max_seq_len)
            if limit > self.kv_budget:
                raise RequestError(f"request {request.request_id!r}: needs {limit} KV tokens "
                                   f"(prompt + max_new_tokens), more than "
                                   f"engine.kv_budget_tokens = {self.kv_budget}; it could "
                                   "never be admitted")
            checked.append((request, prompt, limit))
        ids = [r.request_id for r in requests]
        if len(set(ids)) < len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise RequestError(f"request {dup!r}: request_id appears twice in one batch")
        now = time.time()
        with self._cv:
            if self._closed or self._error:
                raise EngineClosedError(f"engine {self.engine_id} is closed "
                                        f"({self._error or 'close() was called'})")
            for request, _, _ in checked:
                if request.request_id in self._live:
                    raise RequestError(f"request {request.request_id!r}: request_id is "
                                       "already in flight on this engine")
            for request, prompt, limit in checked:
                p = request.params
                if p.seed is None:
                    seed = int(np.random.default_rng([self.config.seed, self._seed_counter])
                               .integers(2**32))
                    self._seed_counter += 1
                else:
                    seed = int(p.seed) % 2**32
                for i in range(int(p.n)):
                    self._queue.append(Sample(request, i, prompt, seed, limit, now))
                self._live[request.request_id] = int(p.n)
            self._cv.notify_all()

    def get_completions(self, timeout: Optional[float] = 0.0,
                        max_items: Optional[int] = None) -> List[Completion]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._outbox:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._closed or self._error:
                    break
                self._cv.wait(left)
            n = len(self._outbox) if max_items is None else min(max_items, len(self._outbox))
            return [self._outbox.popleft() for _ in range(n)]

    def generate(self, requests: Sequence[GenerationRequest],
                 timeout: Optional[float] = None) -> List[Completion]:
        requests = list(requests)
        self.submit_batch(requests)  # all or nothing, one arrival
        wanted = {r.request_id for r in requests}
        total = sum(int(r.params.n) for r in requests)
        got: Dict[tuple, Completion] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(got) < total:
            with self._cv:
                mine = [c for c in self._outbox if c.request_id in wanted]
                for c in mine:
                    self._outbox.remove(c)
                    got[(c.request_id, c.sample_index)] = c
                if len(got) >= total:
                    break
                if self._error or self._closed:
                    raise EngineClosedError(f"engine stopped during generate: "
                                            f"{self._error or 'closed'}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"generate: {total - len(got)} samples unfinished after "
                                       f"{timeout}s")
                if self._thread is not None:
                    self._cv.wait(left if left is not None else 1.0)
                    continue
                if self._paused:
                    raise RuntimeError("generate: the engine is paused and has no loop thread")
            self._step()
        order = {r.request_id: i for i, r in enumerate(requests)}
        return sorted(got.values(), key=lambda c: (order[c.request_id], c.sample_index))

    def abort(self, request_id: str) -> int:
        with self._step_mutex:
            with self._cv:
                queued = [s for s in self._queue if s.request.request_id == request_id]
                for s in queued:
                    self._queue.remove(s)
            running = [i for i, s in enumerate(self._slots)
                       if s is not None and s.request.request_id == request_id]
            if running:
                free = np.zeros((self.num_slots,), bool)
                free[running] = True
                self._slots_dev = self._fns.release(self._slots_dev, free)
            for s in queued + [self._slots[i] for i in running]:
                self._finish(s, "abort")
            return len(queued) + len(running)

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        """Starts the background serving thread (idempotent)."""
        with self._cv:
            if self._closed:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name=f"{self.engine_id}-loop",
                                            daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closed and self._pending is None and (
                            self._paused or not (self._queue or any(self._slots))):
                        self._cv.wait()
                    if self._closed:
                        return
                self._step()
        except Exception as e:  # noqa: BLE001 - surfaced through health() and callers
            with self._cv:
                self._error = f"{type(e).__name__}: {e}"
                self._cv.notify_all()
            self._abort_all()

    def step(self) -> int:
        """One scheduling iteration (update, admit + prefill, one decode chunk); returns the
        number of tokens sampled. Only for engines driven without `start()`."""
        if self._thread is not None:
            raise RuntimeError("step() drives engines without a loop thread; this one has one")
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        return self._step()

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        with self._cv:
            self._paused = True
        with self._step_mutex:  # returns once the step in progress (if any) has ended
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def health(self) -> Dict[str, Any]:
        with self._cv:
            return {"ok": self._error is None and not self._closed, "version": self._version,
                    "running": self._thread is not None and self._thread.is_alive(),
                    "paused": self._paused, "closed": self._closed, "error": self._error,
                    "engine_id": self.engine_id}

    def stats(self) -> Dict[str, Any]:
        now = time.perf_counter()
        with self._cv:
            w, c = self._window, self._counters
            span = max(now - self._window_start, 1e-9)
            running = [s for s in self._slots if s is not None]
            out = {
                "engine_id": self.engine_id,
                "version": self._version,
                "num_slots": self.num_slots,
                "active_slots": len(running),
                "queued_samples": len(self._queue),
                "queued_requests": len({s.request.request_id for s in self._queue}),
                "kv_tokens_in_use": sum(s.pos + 1 for s in running),
                "kv_tokens_reserved": self._reserved,
                "kv_budget_tokens": self.kv_budget,
                # averages over the window since the previous stats() call
                "window_s": span,
                "tokens_per_s": w["tokens"] / span,
                "busy_fraction": min(w["busy_s"] / span, 1.0),
                "slot_occupancy": w["slot_steps"] / max(w["decode_steps"] * self.num_slots, 1),
                "occupancy_while_queued": (w["queued_slot_steps"]
                                           / max(w["queued_steps"] * self.num_slots, 1)),
                "window_decode_steps": w["decode_steps"],
                # totals since the engine started
                "decode_steps": c["decode_steps"],
                "generated_tokens": c["tokens"],
                "completed_samples": c["completed_samples"],
                "prefill_calls": c["prefill_calls"],
                "updates_applied": c["updates_applied"],
                "compiled_programs": sum(f._cache_size() for f in (
                    self._fns.prefill, self._fns.decode, self._fns.release)),
            }
            self._window = collections.Counter()
            self._window_start = now
            return out

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._step_mutex:
            self._abort_all()


def make_jax_engine(cfg, init_checkpoint: str, index: int, workdir: str) -> JaxEngine:
    """The engine of rollout worker `index` (run config `cfg`), started, at version -1 (no
    usable weights until the learner's first version arrives)."""
    model = from_pretrained(init_checkpoint, dtype=cfg.engine.dtype)
    return JaxEngine(model, cfg.engine, version=-1, engine_id=f"jax-{index}", start=True)
