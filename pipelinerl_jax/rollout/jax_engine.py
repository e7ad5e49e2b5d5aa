"""`JaxEngine`: the embedded sampler — continuous batching over a dense or paged KV cache, in
JAX, on the mesh of its role's accelerators (`engine_programs.py`).

Scheduling: each `step()` applies a pending weight update, admits queued samples into free
slots while the KV budget allows (batched prefill), and runs one decode chunk of up to
`steps_per_sync` steps on device; the engine's `SlotScheduler` (`jax_scheduler.py`) does it.
A sample is one of the `n` samples of a request; each finishes and is returned on its own.

Provenance (DESIGN.md): a token gets `version` = the version live when the forward pass that
sampled it ran, and `kv_version` = the oldest version that wrote the KV it attended to; the
engine tracks, per sample, the version of its oldest KV write (its admission version under
'keep', reset to the new version by a 'recompute' re-prefill). Log-probs: see
`pipelinerl_jax.rollout.sampling` (`engine.logprob_mode`).

KV layout (`engine.kv_layout`): 'dense' (this section's default; the main job and the agent
configs choose 'paged') holds `max_slots × max_seq_len` tokens
of KV and `kv_budget_tokens` is the admission limit that models HBM on an accelerator (how
many tokens of KV the device could hold); 'paged' holds a pool of `kv_budget_tokens` tokens
(or `kv_memory_fraction` of free device memory) in pages of `page_size` that the slots share
(`models/paged_attention.py`, `rollout/page_allocator.py`): admission by free pages, pages
allocated as a sample grows, preemption with recompute when the pool runs dry. Paged decode
attention runs through `engine.attention_kernel` (`models/paged_kernels.py`: a Pallas kernel
on TPU (per shard of the engine mesh) or one GPU under 'auto', the pure-JAX reference on
CPU).

`engine_config` / `validate_engine_config` own the run config's `engine` section and
`make_jax_engine` builds a rollout worker's engine: the 'jax' row of `rollout/factory.py`.
"""
from __future__ import annotations

import os
import threading
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from pipelinerl_jax import config_checks as cfg_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models import (Decoder, LeafSlots, flat_params, from_pretrained,
                                   param_shapes, state_from_flat)
from pipelinerl_jax.models.decoder_config import dtype_of
from pipelinerl_jax.models import paged_kernels
from pipelinerl_jax.models.params import WeightsMismatch
from pipelinerl_jax.models.peft_io import read_peft_dir
from pipelinerl_jax.rollout import engine_memory, engine_programs, engine_steps
from pipelinerl_jax.rollout.engine import (EngineClosedError, InferenceEngine, RequestError,
                                           validate_request)
from pipelinerl_jax.rollout.jax_scheduler import SlotScheduler, buckets
from pipelinerl_jax.rollout.kv_memory import DenseKV, PagedKV
from pipelinerl_jax.rollout.page_allocator import PageAllocator
from pipelinerl_jax.rollout.sampling import LOGPROB_MODES
from pipelinerl_jax.transport.weight_version import (WeightVersion, WeightVersionRefused,
                                                     check_receivable, describe_run)
from pipelinerl_jax.records import Completion, GenerationRequest

KV_POLICIES = ("keep", "recompute")
KV_LAYOUTS = ("dense", "paged")
DTYPES = ("float32", "bfloat16")


def engine_config() -> ml_collections.ConfigDict:
    """Defaults of the `engine` config section (every key is validated by the function below)."""
    c = ml_collections.ConfigDict()
    c.max_slots = 8  # concurrent samples (decode batch rows)
    c.max_seq_len = 256  # context: prompt + generated tokens
    c.kv_budget_tokens = 0  # KV tokens admitted samples may reserve; 0 = max_slots * max_seq_len
    # 'dense': every slot holds max_seq_len tokens of KV; 'paged': a pool of kv_budget_tokens
    # (in pages of page_size tokens) shared by the slots, admission by free pages, preemption
    c.kv_layout = "dense"
    c.page_size = 16  # tokens per KV page (kv_layout='paged')
    # paged decode attention: 'auto' (a Pallas kernel on one TPU/GPU, else the reference),
    # 'reference' (pure JAX, any backend) or 'pallas' (models/paged_kernels.py)
    c.attention_kernel = "auto"
    # paged only: size the pool to this share of the device memory the weights leave free
    # (instead of kv_budget_tokens); 0 = off
    c.kv_memory_fraction = 0.0
    # paged only: keep finished samples' full KV pages (evicted first when pages run short)
    # and map them into later requests whose prompts start with their tokens (multi-turn)
    c.prefix_cache = True
    # kv_policy='keep': reuse retained pages written at most this many versions before the
    # live one (0: only the live version's, so reuse never makes a kv_version older)
    c.prefix_cache_max_lag = 0
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
    # the engine mesh's tensor axis (heads, MLP and the KV cache split over it, as the
    # learner's rules say; engine_programs.py); 0 = every device the role is given (one on CPU)
    c.tensor_parallel = 0
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
    cfg_lib.positive_int(root, k("tensor_parallel"), allow_zero=True)
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
    cfg_lib.one_of(root, k("kv_layout"), KV_LAYOUTS)
    cfg_lib.positive_int(root, k("page_size"))
    cfg_lib.one_of(root, k("attention_kernel"), paged_kernels.ATTENTION_KERNELS)
    if cfg["page_size"] > max_seq_len:
        raise cfg_lib.ConfigError(k("page_size"), f"{cfg['page_size']} exceeds max_seq_len "
                                                  f"{max_seq_len}")
    fraction = cfg_lib.number(root, k("kv_memory_fraction"), 0.0, 1.0)
    if fraction > 0 and cfg["kv_layout"] != "paged":
        raise cfg_lib.ConfigError(k("kv_memory_fraction"), "sizes the page pool: only with "
                                  f"{k('kv_layout')}='paged'")
    if fraction > 0 and cfg["kv_budget_tokens"]:
        raise cfg_lib.ConfigError(k("kv_memory_fraction"), f"and {k('kv_budget_tokens')} "
                                  "both size the page pool: set one")
    if not isinstance(cfg["prefix_cache"], bool):
        raise cfg_lib.ConfigError(k("prefix_cache"), f"must be True or False, got "
                                  f"{cfg['prefix_cache']!r}")
    cfg_lib.positive_int(root, k("prefix_cache_max_lag"), allow_zero=True)
    if cfg["prefix_cache_max_lag"] and cfg["kv_policy"] == "recompute":
        raise cfg_lib.ConfigError(k("prefix_cache_max_lag"), "only with "
                                  f"{k('kv_policy')}='keep' ('recompute' reuses only the "
                                  "live version's pages)")
    cfg_lib.one_of(root, k("logprob_mode"), LOGPROB_MODES)
    cfg_lib.one_of(root, k("dtype"), DTYPES)


def validate_run_config(cfg, selected: bool) -> None:
    """The `engine` section of run config `cfg` (the 'jax' row's check), whatever
    `sampler.kind` is, so a switch of kind finds no surprise."""
    validate_engine_config(cfg.engine, "engine")


class JaxEngine(InferenceEngine):
    """Continuous-batching JAX sampler with in-flight weight updates (module docstring).

    `model` is a `Decoder` (its weights are copied) or an HF checkpoint directory; `config`
    overrides `engine_config()` (a dict or ConfigDict); `version` is the version of the
    initial weights; `mesh` places the parameters by the logical-axis rules (default: one
    device). `serves`: the `WeightVersion` description of the versions it installs ('full',
    or 'lora': `model` is then the frozen base, held once, and a version swaps only the
    adapters, applied unmerged in the forward; docs/lora.md). Without `start()` the caller drives the engine with `step()` (deterministic
    tests); with `start()` (or `start=True`) a background thread does, and every public
    method is thread-safe.

    The engine validates requests, turns weights into a parameter state and runs the loop
    thread; its `SlotScheduler` (`self.scheduler`) owns the slots, the queue, the device
    state and every step.
    """

    def __init__(self, model: Any, config: Optional[Mapping] = None, *, version: int = 0,
                 engine_id: str = "jax-engine", mesh=None, start: bool = False,
                 serves: WeightVersion = WeightVersion("full")):
        cfg = engine_config()
        if config is not None:
            cfg.update(config)
        validate_engine_config(cfg)
        self.config = cfg
        self.engine_id = engine_id
        self.dtype = dtype_of(cfg.dtype)
        if isinstance(model, (str, os.PathLike)):
            model = from_pretrained(os.fspath(model), dtype=self.dtype)
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a Decoder or a checkpoint path, got {type(model)}")
        self.model_config = model.cfg.replace(dtype=self.dtype, param_dtype=self.dtype)
        if cfg.max_seq_len > self.model_config.max_position_embeddings:
            raise cfg_lib.ConfigError(
                "engine.max_seq_len", f"{cfg.max_seq_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}")
        self.num_slots = cfg.max_slots
        self.max_seq_len = cfg.max_seq_len
        self.kv_budget = cfg.kv_budget_tokens or cfg.max_slots * cfg.max_seq_len

        # ---- device state: parameters, KV cache, per-slot state, on the engine mesh
        # (`engine_programs.py`: placement, and the programs every step runs)
        self._mesh = mesh if mesh is not None else sharding_lib.make_mesh((1, 1, 1))
        devices = list(self._mesh.devices.flat)
        self.page_size = cfg.page_size if cfg.kv_layout == "paged" else 0
        pool, layout = None, None
        if self.page_size:  # the pool: kv_budget_tokens in whole pages, or a memory share
            layout = engine_programs.paged_layout(self.model_config, cfg, self._mesh)[1:]
            num_pages = (engine_memory.pool_pages_for_memory(
                self.model_config, self.page_size, self.dtype, cfg.kv_memory_fraction, devices,
                layout=layout)
                if cfg.kv_memory_fraction else -(-self.kv_budget // self.page_size))
            self.kv_budget = num_pages * self.page_size
            pool = (num_pages, self.page_size)
        self.serves = serves.description()
        self.lora = serves.lora
        self.programs = engine_programs.engine_programs(
            self.model_config, cfg, self._mesh, num_pages=pool[0] if pool else None,
            lora=self.lora)
        self._abstract_state = self.programs.params
        self._param_shardings = self.programs.param_shardings
        shapes = param_shapes(self._abstract_state)
        self._adapter_shapes = None if self.lora is None else {
            k: v for k, v in shapes.items() if k.endswith(("_lora_a", "_lora_b"))}
        # where the adapters sit in the live state: a version swaps just them (`_install`)
        self._adapter_slots = None if self.lora is None else LeafSlots(
            self._abstract_state, sorted(self._adapter_shapes), self._param_shardings)
        itemsize = np.dtype(self.dtype).itemsize
        # held: the live weights, plus the next version's while it is staged (LoRA: adapters,
        # and, while they are placed, the one packed buffer they travel in, on every device:
        # `LeafSlots`)
        staged = sum(int(np.prod(v)) for v in (self._adapter_shapes or shapes).values())
        if self.lora is not None:
            staged *= 1 + len(devices)
        self.memory = engine_memory.check_fits(  # before allocating: a clear error, no OOM
            self.model_config, cfg.max_slots, cfg.max_seq_len, self.dtype, devices,
            pages=pool, pool_key="kv_memory_fraction" if cfg.kv_memory_fraction
            else "kv_budget_tokens", layout=layout,
            weights=sum(int(np.prod(v)) for v in shapes.values()) * itemsize,
            staged=staged * itemsize)
        # the paged decode attention's implementation (`paged_kernels.IMPLS`; dense: unused)
        self.attention_impl = self.programs.kernel.impl
        initial = self._materialise(model)
        self.pages = (PageAllocator(*pool, cfg.max_slots, self.programs.max_pages)
                      if pool else None)
        zeros = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                             self.programs.cache),
                        out_shardings=self.programs.cache_sharding)
        replicated = self.programs.replicated
        kv = (PagedKV(self.pages, cfg.steps_per_sync, bool(cfg.prefix_cache),
                      0 if cfg.kv_policy == "recompute" else cfg.prefix_cache_max_lag,
                      rows=buckets((), 8, cfg.max_slots))
              if pool else DenseKV(cfg.max_slots, self.kv_budget))
        self.scheduler = SlotScheduler(
            self.programs.fns, initial, zeros(),  # (the cache born in its shardings)
            jax.device_put(engine_steps.empty_slots(cfg.max_slots, cfg.max_stop_tokens),
                           replicated), kv,
            num_slots=cfg.max_slots, max_seq_len=cfg.max_seq_len,
            prefill_buckets=buckets(cfg.prefill_buckets, 16, cfg.max_seq_len),
            cache_buckets=buckets(cfg.cache_buckets, 64, cfg.max_seq_len),
            batch_buckets=buckets((), 1, cfg.max_prefill_batch),
            steps=cfg.steps_per_sync,
            refill=cfg.refill_threshold or max(1, cfg.max_slots // 8),
            max_stops=cfg.max_stop_tokens, kv_policy=cfg.kv_policy, seed=cfg.seed,
            version=int(version), engine_id=engine_id)
        self.prefill_buckets = self.scheduler.prefill_buckets
        self.cache_buckets = self.scheduler.cache_buckets
        self.batch_buckets = self.scheduler.batch_buckets

        self._thread_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        if start:
            self.start()

    # ------------------------------------------------------------------ weights

    def _materialise(self, weights: Any) -> nnx.State:
        """The engine's first parameter state, from a model, a state, a flat dict or a
        checkpoint directory: every weight ('full'), or the base with zero adapters ('lora':
        the base's own outputs until the first version)."""
        if isinstance(weights, (str, os.PathLike)):
            weights = from_pretrained(os.fspath(weights), dtype=self.dtype)
        if isinstance(weights, (nnx.Module, nnx.State)):
            weights = flat_params(weights, host=False)
        elif not isinstance(weights, Mapping):
            raise TypeError("weights must be a flat {path: array} dict, an nnx.State, a model "
                            f"or a checkpoint path, got {type(weights).__name__}")
        if self.lora is not None:
            weights = {**{k: v for k, v in weights.items() if k not in self._adapter_shapes},
                       **{k: np.zeros(s, self.dtype) for k, s in self._adapter_shapes.items()}}
        return state_from_flat(self._abstract_state, weights, self._param_shardings)

    def weight_shapes(self) -> Dict[str, tuple]:
        """`{name: shape}` of what a published version carries (the transport checks it):
        the adapters under LoRA, else every weight."""
        if self._adapter_shapes is not None:
            return dict(self._adapter_shapes)
        return param_shapes(self._abstract_state)

    def _install(self, message: WeightVersion) -> nnx.State:
        """The parameter state that serves `message` (checked against `serves` first):
        'full', every weight placed fresh in the engine's dtype and shardings; 'lora', the
        live state's base arrays themselves (no copy) with the new adapters placed in.
        The one point where a version's tensors reach the device."""
        check_receivable(self.serves, message)
        tensors = message.tensors
        if message.kind == "full":
            if tensors is None:
                tensors = flat_params(from_pretrained(message.path, dtype=self.dtype),
                                      host=False)
            return state_from_flat(self._abstract_state, tensors, self._param_shardings)
        if tensors is None:
            tensors, _ = read_peft_dir(message.path, self.model_config)
        self._check_adapters(tensors)
        return self._adapter_slots.replace(self.scheduler.params, tensors)

    def _check_adapters(self, adapters: Mapping[str, Any]) -> None:
        """Exactly this engine's adapter names and shapes, else `WeightsMismatch`."""
        expected = self._adapter_shapes
        missing = sorted(set(expected) - set(adapters))
        unknown = sorted(set(adapters) - set(expected))
        if missing or unknown:
            raise WeightsMismatch(f"adapters do not match this engine's base and LoRA targets "
                                  f"{list(self.lora.targets)}: missing {missing[:5]}, unknown "
                                  f"{unknown[:5]}")
        for name, shape in expected.items():
            got = tuple(np.shape(adapters[name]))
            if got != shape:
                raise WeightsMismatch(f"adapters: {name!r} has shape {got}, this engine needs "
                                      f"{shape} (rank {self.lora.rank})")

    @property
    def version(self) -> int:
        return self.scheduler.version

    @property
    def params(self) -> nnx.State:
        """The live parameter state (what the next forward pass uses)."""
        return self.scheduler.params

    def update_weights(self, weights: Any, version: int, *, wait: bool = True,
                       timeout: Optional[float] = None, allow_older: bool = False) -> None:
        """See `InferenceEngine.update_weights`. `weights`: a `WeightVersion` (dispatched on
        its kind; refused, `WeightVersionRefused`, unless it is what `serves` says), or, for
        an engine serving 'full' versions, a flat dict, state, model or checkpoint path.
        `allow_older` lets lag injection install an older version on purpose (never used by
        a normal run)."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"update_weights: version must be an integer, got {version!r}")
        version = int(version)
        self.scheduler.check_newer(version, allow_older)
        if not isinstance(weights, WeightVersion):
            if self.lora is not None:
                raise WeightVersionRefused(
                    f"update_weights({version}): this engine serves LoRA versions; hand it a "
                    f"WeightVersion of kind 'lora', not a {type(weights).__name__}")
            if isinstance(weights, (nnx.Module, nnx.State)):
                weights = flat_params(weights, host=False)
            weights = (WeightVersion("full").carrying(version, path=os.fspath(weights))
                       if isinstance(weights, (str, os.PathLike)) else
                       WeightVersion("full").carrying(version, tensors=weights))
        params = self._install(weights)  # the slow part, outside every lock
        self.scheduler.stage_update(params, version, allow_older)
        if self._thread is None:
            self.scheduler.apply_update_now()
            return
        if wait:
            self.scheduler.wait_live(version, allow_older, timeout)

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
                                      self.config.max_stop_tokens)
            limit = min(len(prompt) + int(request.params.max_new_tokens), self.max_seq_len)
            # (paged: K/V is stored for every position but the last, which is only sampled)
            if (limit - 1 if self.page_size else limit) > self.kv_budget:
                raise RequestError(f"request {request.request_id!r}: needs {limit} KV tokens "
                                   f"(prompt + max_new_tokens), more than "
                                   f"engine.kv_budget_tokens = {self.kv_budget}; it could "
                                   "never be admitted")
            checked.append((request, prompt, limit))
        ids = [r.request_id for r in requests]
        if len(set(ids)) < len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise RequestError(f"request {dup!r}: request_id appears twice in one batch")
        self.scheduler.enqueue(checked)

    def get_completions(self, timeout: Optional[float] = 0.0,
                        max_items: Optional[int] = None, *,
                        request_ids: Optional[AbstractSet[str]] = None) -> List[Completion]:
        return self.scheduler.take(timeout, max_items, request_ids)

    def _drive(self) -> bool:
        if self._thread is not None:
            return False
        if self.scheduler.status()["paused"]:
            raise RuntimeError("generate: the engine is paused and has no loop thread")
        self.scheduler.step()
        return True

    def _stopped(self) -> Optional[str]:
        return self.scheduler.stopped()

    def abort(self, request_id: str) -> int:
        return self.scheduler.abort(request_id)

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        """Starts the background serving thread (idempotent)."""
        with self._thread_lock:
            if self.scheduler.closed:
                raise EngineClosedError(f"engine {self.engine_id} is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name=f"{self.engine_id}-loop",
                                            daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while self.scheduler.wait_for_work():
                self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - surfaced through health() and callers
            self.scheduler.fail(f"{type(e).__name__}: {e}")

    def step(self) -> int:
        """One scheduling iteration (update, admit + prefill, one decode chunk); returns the
        number of tokens sampled. Only for engines driven without `start()`."""
        if self._thread is not None:
            raise RuntimeError("step() drives engines without a loop thread; this one has one")
        if self.scheduler.closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")
        return self.scheduler.step()

    def warmup(self) -> int:
        """Compiles every program serving can need up front (`SlotScheduler.warmup`)."""
        return self.scheduler.warmup()

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        self.scheduler.pause()

    def resume(self) -> None:
        self.scheduler.resume()

    def health(self) -> Dict[str, Any]:
        st = self.scheduler.status()
        return {"ok": st["error"] is None and not st["closed"], "version": st["version"],
                "running": self._thread is not None and self._thread.is_alive(),
                "paused": st["paused"], "closed": st["closed"], "error": st["error"],
                "engine_id": self.engine_id}

    def stats(self) -> Dict[str, Any]:
        return self.scheduler.stats()

    def close(self) -> None:
        if not self.scheduler.close():
            return
        if self._thread is not None:
            self._thread.join()
        self.scheduler.abort_all()


def make_jax_engine(cfg, init_checkpoint: str, index: int, workdir: str) -> JaxEngine:
    """The engine of rollout worker `index` (run config `cfg`), started, at version -1 (no
    usable weights until the learner's first version arrives)."""
    model = from_pretrained(init_checkpoint, dtype=cfg.engine.dtype)
    mesh = engine_programs.engine_mesh(cfg.engine.tensor_parallel)  # the role's devices
    return JaxEngine(model, cfg.engine, version=-1, engine_id=f"jax-{index}", start=True,
                     serves=describe_run(cfg, init_checkpoint), mesh=mesh)
