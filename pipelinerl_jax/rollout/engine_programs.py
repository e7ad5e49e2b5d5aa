"""The `JaxEngine`'s device programs on its mesh: where every array lives, and the abstract
inputs of each program, so the same programs the engine runs can be compiled ahead of time
for a TPU topology from a CPU host (`experiments/compile_check.py`).

Placement on the engine mesh (the accelerators its role is given, axes `('data', 'fsdp',
'tensor')`, normally `(1, 1, T)`):

    weights       the learner's logical-axis rules (`sharding.DEFAULT_RULES`: attention
                  heads, MLP and vocab on `tensor`), except that the kv-head axis is
                  replicated when `tensor` exceeds the model's kv heads (vLLM's choice);
    KV cache      sharded on its (stored) kv heads over `tensor`: dense `[S, K, ...]`, paged
                  `[P, C, 2K', X']` (`models/paged_attention.py`: with `tensor` > K the pool
                  stores K' = `tensor` heads, one copy per shard of the head its queries read);
    page tables, slot state, sampled tokens: replicated (the host's scheduler owns them).

The Pallas TPU kernel runs per shard under `shard_map` (`models/paged_kernels.py`).

    progs = engine_programs(model_cfg, engine_cfg, mesh)   # no weights, no device memory
    progs.fns.decode.lower(*progs.decode_args(8), cache_len=256, rows=8).compile()
    progs.fns.prefill.lower(*progs.prefill_args(batch=4, length=128)).compile()

(For a TPU topology from a CPU host: build and lower inside `with jax.default_device(<a
topology device>)`, and pass the kernel's `block_sizes`.)

`JaxEngine` builds itself from the same call, so what compiles here is what it runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipelinerl_jax import config_checks as cfg_lib
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models import Decoder
from pipelinerl_jax.models import paged_kernels
from pipelinerl_jax.models.lora import add_lora
from pipelinerl_jax.models.decoder_config import dtype_of
from pipelinerl_jax.models.paged_attention import (LANES, init_paged_cache, padded_head_dim,
                                                   stored_kv_heads)
from pipelinerl_jax.rollout import engine_steps
from pipelinerl_jax.rollout.decode_step import init_engine_cache
from pipelinerl_jax.rollout.page_allocator import pages_for
from pipelinerl_jax.rollout.sampling import RowParams

TENSOR_KEY = "engine.tensor_parallel"


def engine_mesh(tensor: int = 0, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A `(1, 1, tensor)` mesh over the first `tensor` of `devices` (default: the devices
    this process sees, i.e. its role's); `tensor=0`: all of them on an accelerator, one on
    CPU (virtual host devices share the process's cores: splitting the model over them gains
    nothing, and a test process's 8 of them would split a tiny model's heads)."""
    devices = list(jax.devices() if devices is None else devices)
    tensor = tensor or (1 if devices[0].platform == "cpu" else len(devices))
    if tensor > len(devices):
        raise cfg_lib.ConfigError(TENSOR_KEY, f"{tensor} exceeds the {len(devices)} "
                                              f"{devices[0].platform} device(s) of this role")
    return sharding_lib.make_mesh((1, 1, tensor), devices)


def engine_rules(model_cfg, mesh: Mesh) -> tuple:
    """The learner's rules, the kv-head axis replicated when `tensor` does not divide the kv
    heads; `ConfigError` naming `engine.tensor_parallel` when the heads cannot split."""
    t = mesh.shape["tensor"]
    k, h = model_cfg.num_kv_heads, model_cfg.num_heads
    try:
        stored_kv_heads(k, t)
    except ValueError as e:
        raise cfg_lib.ConfigError(TENSOR_KEY, str(e)) from None
    if h % t:
        raise cfg_lib.ConfigError(TENSOR_KEY, f"a tensor axis of {t} does not divide the "
                                              f"model's {h} attention heads")
    if k % t == 0:
        return sharding_lib.DEFAULT_RULES
    return tuple((name, None if name == "kv_heads" else axes)
                 for name, axes in sharding_lib.DEFAULT_RULES)


@dataclasses.dataclass
class EnginePrograms:
    """The compiled-on-first-call programs of one engine shape on one mesh, the shardings
    of their inputs, and abstract (`ShapeDtypeStruct`, sharded) inputs to lower them with."""
    fns: engine_steps.StepFns
    kernel: paged_kernels.AttentionKernel  # the paged decode attention (dense: 'reference')
    mesh: Mesh
    param_shardings: Any  # nnx.State of NamedShardings
    cache_sharding: NamedSharding
    replicated: NamedSharding
    params: Any  # nnx.State of ShapeDtypeStruct
    cache: Any  # KVCache / PagedKVCache of ShapeDtypeStruct
    slots: Any  # SlotState of ShapeDtypeStruct
    num_slots: int
    max_stops: int
    num_pages: int = 0  # paged: pool pages (0: dense)
    max_pages: int = 0  # paged: page-table width

    def _arr(self, shape, dtype):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=self.replicated)

    def _tables(self, rows: int) -> tuple:
        return (self._arr((rows, self.max_pages), np.int32),) if self.num_pages else ()

    def row_params(self, b: int) -> RowParams:
        i32, f32 = np.int32, np.float32
        return RowParams(seed=self._arr((b,), np.uint32), sample_index=self._arr((b,), i32),
                         temperature=self._arr((b,), f32), top_p=self._arr((b,), f32),
                         top_k=self._arr((b,), i32),
                         stop_ids=self._arr((b, self.max_stops), i32),
                         limit=self._arr((b,), i32))

    def prefill_args(self, batch: int, length: int) -> tuple:
        """`fns.prefill`'s arguments for `batch` prompts padded to `length` tokens."""
        v = self._arr((batch,), np.int32)
        return (self.params, self.cache, self.slots, self._arr((batch, length), np.int32), v,
                v, self.row_params(batch), *self._tables(batch))

    def decode_args(self, rows: Optional[int] = None) -> tuple:
        """`fns.decode`'s positional arguments for a chunk over the first `rows` slots
        (default: all); pass `rows=` (a row bucket: `SlotScheduler.row_buckets`; dense: all
        slots) and `cache_len=` (a cache-length bucket) as keywords too."""
        return (self.params, self.cache, self.slots, self._arr((), np.int32),
                *self._tables(rows or self.num_slots))


def paged_layout(model_cfg, cfg, mesh: Mesh, block_sizes: tuple = ()) -> tuple:
    """(the paged decode attention's `AttentionKernel`, the kv heads K' and head_dim X' its
    pool stores) for `engine.attention_kernel` on `mesh`'s platform."""
    devices = list(mesh.devices.flat)
    try:
        impl = paged_kernels.resolve_attention_kernel(cfg.attention_kernel,
                                                      devices[0].platform, len(devices))
    except ValueError as e:
        raise cfg_lib.ConfigError("engine.attention_kernel", str(e)) from None
    kernel = paged_kernels.AttentionKernel(impl, mesh if len(devices) > 1 else None,
                                           tuple(block_sizes))
    lanes = LANES if impl == "tpu_ragged" else 1
    return (kernel, stored_kv_heads(model_cfg.num_kv_heads, mesh.shape["tensor"]),
            padded_head_dim(model_cfg.head_dim, lanes))


def engine_programs(model_cfg, cfg, mesh: Mesh, *, num_pages: Optional[int] = None,
                    block_sizes: tuple = (), lora=None) -> EnginePrograms:
    """The programs of an engine of model `model_cfg` with `engine` section `cfg` (defaults
    filled, validated) on `mesh`. Paged: a pool of `num_pages` pages (default:
    `kv_budget_tokens`, else `max_slots * max_seq_len` tokens, in whole pages).
    `block_sizes`: the TPU kernel's `(("num_kv_pages_per_block", n),
    ("num_queries_per_block", m))` (ahead-of-time compiles; serving leaves its tuned table).
    `lora` (a `LoRASpec`): the model carries adapters, applied unmerged in every forward."""
    dtype = dtype_of(cfg.dtype)
    model_cfg = model_cfg.replace(dtype=dtype, param_dtype=dtype)
    rules = engine_rules(model_cfg, mesh)

    def build():
        m = Decoder(model_cfg, nnx.Rngs(0))
        return m if lora is None else add_lora(m, lora, nnx.Rngs(0))
    abstract = nnx.split(nnx.eval_shape(build))[1]
    try:
        param_shardings = sharding_lib.state_shardings(abstract, mesh, rules)
    except sharding_lib.ShardingError as e:
        raise cfg_lib.ConfigError(TENSOR_KEY, str(e)) from None
    replicated = NamedSharding(mesh, P())
    paged = cfg.kv_layout == "paged"
    t = mesh.shape["tensor"]
    kernel = paged_kernels.AttentionKernel()
    if paged:
        kernel, heads, width = paged_layout(model_cfg, cfg, mesh, block_sizes)
        if num_pages is None:
            budget = cfg.kv_budget_tokens or cfg.max_slots * cfg.max_seq_len
            num_pages = -(-budget // cfg.page_size)
        cache = jax.eval_shape(lambda: init_paged_cache(
            model_cfg, num_pages, cfg.page_size, kv_heads=heads, head_dim=width))
        spec = P(None, None, "tensor")  # [pages, page, 2K', X']
    else:
        num_pages = 0
        cache = jax.eval_shape(lambda: init_engine_cache(model_cfg, cfg.max_slots,
                                                         cfg.max_seq_len))
        spec = P(None, "tensor") if model_cfg.num_kv_heads % t == 0 else P()  # [S, K, ...]
    cache_sharding = NamedSharding(mesh, spec)
    fns = engine_steps.step_fns(model_cfg, cfg.max_seq_len, cfg.steps_per_sync,
                                cfg.logprob_mode, cache_sharding, replicated,
                                cfg.page_size if paged else 0, kernel, lora)

    def placed(tree, sharding):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            tree, sharding)
    slots = jax.eval_shape(lambda: engine_steps.empty_slots(cfg.max_slots,
                                                            cfg.max_stop_tokens))
    return EnginePrograms(
        fns=fns, kernel=kernel, mesh=mesh, param_shardings=param_shardings,
        cache_sharding=cache_sharding, replicated=replicated,
        params=placed(abstract, param_shardings),
        cache=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                          sharding=cache_sharding), cache),
        slots=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                          sharding=replicated), slots),
        num_slots=cfg.max_slots, max_stops=cfg.max_stop_tokens, num_pages=num_pages,
        max_pages=pages_for(cfg.max_seq_len, cfg.page_size) if paged else 0)
