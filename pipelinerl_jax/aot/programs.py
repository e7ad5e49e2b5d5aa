"""The programs a run executes, for its role split on a TPU topology, with abstract inputs.

Nothing here allocates a weight: models are `nnx.eval_shape`d, and every input is a
`jax.ShapeDtypeStruct` carrying the sharding the run gives it. Each `Program` lowers the
run's own jitted function, so what compiles here is what the run executes:

    learner/train_step        `learner/loop.make_step` over `train_step.abstract_state` on the
                              learner mesh (`mesh.shape` over `resources.learner_devices`),
                              the packed batch at its largest row bucket (one sequence a row:
                              the most rows a batch can pack into), LoRA or full parameters;
    learner/publish           the snapshot a version is published from
                              (`multihost.snapshot_program`: a copy of the params cast to
                              `learner.publish_dtype`), alive while the next train step runs
                              (until its transfer to host ends): its HBM is the train step's
                              plus the snapshot (`alongside`), the worst case;
    engine/prefill[b,t]       the engine's prefill (`rollout/engine_programs.py`) at its
                              largest batch and prompt buckets;
    engine/decode[rows,len]   the engine's decode chunk (`engine.steps_per_sync` steps, paged,
                              the Pallas kernel per shard) at every slot and the largest
                              attention-length bucket (without the kernel, the smallest too:
                              the two give the simulator its per-context cost);
    engine/reshard            a weight update on the engine's chips: the learner's layout
                              (its mesh shape, or fsdp over the engine's chips when the counts
                              differ) and published dtype into the engine's shardings and
                              dtype, as one jitted copy (under LoRA the adapters alone: the
                              engine keeps its base); the engine keeps serving meanwhile, so
                              its live weights and KV pool are resident too (`resident`).

Roles and chips. The learner takes `resources.learner_devices` of its topology (default: the
first `prod(mesh.shape)`); a rollout worker takes its block of `resources.sampler_devices`
(split evenly over `rollout.num_workers`) of the sampler's topology (default: the next device
after the learner's on a shared topology, the first on a slice of its own), and its engine
mesh is `engine.tensor_parallel` of them (0: all).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.learner import batching, loop, multihost, train_step as ts
from pipelinerl_jax.models import Decoder
from pipelinerl_jax.models.decoder_config import dtype_of
from pipelinerl_jax.models.factory import resolve_model_config
from pipelinerl_jax.models.lora import add_lora, is_adapter_name, lora_spec
from pipelinerl_jax.models.params import flat_params
from pipelinerl_jax.resources import parse_indices
from pipelinerl_jax.rollout.engine_programs import engine_mesh, engine_programs
from pipelinerl_jax.rollout.jax_scheduler import buckets
from pipelinerl_jax.rollout.page_allocator import pages_for
from pipelinerl_jax.run_config import completion_tokens, publish_dtype
from pipelinerl_jax.tokenizer import get_tokenizer

# The TPU kernel's block sizes for an ahead-of-time compile (its tuned table reads the
# default device, which is the CPU host's here): KV pages per block at most this, and no more
# than the smallest attention-length bucket reads (the kernel's bound).
KV_PAGES_PER_BLOCK = 8
QUERIES_PER_BLOCK = 32


def block_sizes(engine_cfg) -> tuple:
    """The TPU kernel's `(name, value)` block sizes for every bucket of `engine_cfg`."""
    smallest = buckets(engine_cfg.cache_buckets, 64, engine_cfg.max_seq_len)[0]
    pages = max(1, min(KV_PAGES_PER_BLOCK, pages_for(smallest, engine_cfg.page_size)))
    return (("num_kv_pages_per_block", pages), ("num_queries_per_block", QUERIES_PER_BLOCK))


@dataclasses.dataclass
class Program:
    """One program: `lower()` gives its `jax.stages.Lowered`; `config_key` is what to change
    when it does not fit; `work` what one call does (tokens, steps, rows) for per-token
    costs; `resident_from` names a program whose arguments stay in HBM while it runs."""
    name: str
    role: str  # 'learner' | 'sampler'
    lower: Callable[[], Any]
    config_key: str
    work: dict
    devices: Sequence[Any]
    resident_from: Optional[str] = None  # a program whose arguments stay resident
    # a program whose whole footprint is live beside this one's outputs (the published
    # snapshot beside the next train step): HBM = that program's + these outputs
    alongside: Optional[str] = None
    # concrete inputs -> inputs that make the program do its full work (a decode's slots
    # active, near the end of its attention bucket), for running it for real
    busy: Optional[Callable] = None


def model_config(cfg):
    """The run's `ModelConfig` (shape only; init='hf' reads config.json, no weights)."""
    vocab = 0 if cfg.model.init == "hf" else get_tokenizer(cfg.tokenizer).vocab_size
    return resolve_model_config(cfg.model, vocab)


def _indices(spec: str, key: str, devices: Sequence, default: Sequence[int]) -> List[int]:
    idx = parse_indices(spec, key) if spec else list(default)
    bad = [i for i in idx if i >= len(devices)]
    if bad:
        raise ConfigError(key, f"device(s) {bad} are past the {len(devices)} chips of the "
                               f"topology")
    return idx


def learner_devices(cfg, devices: Sequence) -> list:
    n = math.prod(cfg.mesh.shape)
    idx = _indices(cfg.resources.learner_devices, "resources.learner_devices", devices,
                   range(n))
    if len(idx) < n:
        raise ConfigError("mesh.shape", f"{tuple(cfg.mesh.shape)} needs {n} chips, "
                                        f"resources.learner_devices gives {len(idx)}")
    return [devices[i] for i in idx[:n]]


def worker_devices(cfg, devices: Sequence, shared_with_learner: bool) -> list:
    """The chips of rollout worker 0 (module docstring)."""
    first = math.prod(cfg.mesh.shape) if shared_with_learner else 0
    idx = _indices(cfg.resources.sampler_devices, "resources.sampler_devices", devices,
                   [first])
    w = cfg.rollout.num_workers
    if len(idx) % w:
        raise ConfigError("resources.sampler_devices", f"{len(idx)} chips do not split over "
                                                       f"rollout.num_workers={w}")
    return [devices[i] for i in idx[:len(idx) // w]]


def learner_programs(cfg, devices: Sequence) -> List[Program]:
    """The learner's train step on its mesh (module docstring)."""
    mc = model_config(cfg).replace(dtype=dtype_of(cfg.model.dtype),
                                    param_dtype=dtype_of(cfg.model.param_dtype))
    mesh = sharding_lib.make_mesh(tuple(cfg.mesh.shape), devices)
    spec = lora_spec(cfg)

    def build():
        model = Decoder(mc, nnx.Rngs(0))
        return model if spec is None else add_lora(model, spec, nnx.Rngs(1))
    model = nnx.eval_shape(build)
    optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
    try:
        state = ts.abstract_state(model, optimizer, mesh)
    except sharding_lib.ShardingError as e:
        raise ConfigError("mesh.shape", str(e)) from None
    step = loop.make_step(cfg, model, optimizer, mesh, state)

    L = cfg.learner
    chunks = L.minibatches * L.micro_batches
    num_seqs = L.batch_groups * cfg.rollout.group_size
    per = num_seqs // chunks
    pack_len = cfg.model.max_seq_len
    rows = batching.row_bucket(per, sharding_lib.batch_divisor(mesh))
    like = batching.pack([], 0, num_seqs=num_seqs, chunks=chunks, pack_len=pack_len,
                         completion_len=completion_tokens(cfg)).arrays
    shardings = ts.batch_shardings(mesh)
    batch = {k: jax.ShapeDtypeStruct(
        (chunks, rows, pack_len) if k in batching.PACKED_KEYS else x.shape, x.dtype,
        sharding=shardings[k]) for k, x in like.items()}
    replicated = NamedSharding(mesh, P())
    hparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                           step.hparams)
    train = Program("learner/train_step", "learner",
                    lambda: step.jitted.lower(state, batch, hparams),
                    "learner.micro_batches (or mesh.shape, lora.enabled)",
                    dict(tokens=chunks * rows * pack_len, sequences=num_seqs,
                         chunks=chunks, rows=rows, pack_len=pack_len), devices)
    dtype = publish_dtype(cfg)
    publish = Program("learner/publish", "learner",
                      lambda: multihost.snapshot_program(dtype).lower(state.params),
                      "learner.publish_dtype (or learner.micro_batches, mesh.shape)",
                      dict(params=sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
                           dtype=str(dtype or "as trained")), devices, alongside=train.name)
    return [train, publish]


def sampler_programs(cfg, devices: Sequence, *, all_buckets: bool = False) -> List[Program]:
    """The engine's prefill and decode buckets and a weight update on worker 0's chips."""
    mc = model_config(cfg)
    e = cfg.engine
    mesh = engine_mesh(e.tensor_parallel, devices)
    # a LoRA run's engine serves the adapters unmerged (`describe_run`): its model has them
    progs = engine_programs(mc, e, mesh, block_sizes=block_sizes(e), lora=lora_spec(cfg))
    fns, out = progs.fns, []
    prefill_b = buckets((), 1, e.max_prefill_batch)
    prefill_t = buckets(e.prefill_buckets, 16, e.max_seq_len)
    cache_l = buckets(e.cache_buckets, 64, e.max_seq_len)
    paged = e.kv_layout == "paged"
    for b in (prefill_b if all_buckets else prefill_b[-1:]):
        for t in (prefill_t if all_buckets else prefill_t[-1:]):
            out.append(Program(f"engine/prefill[b={b},t={t}]", "sampler",
                               lambda b=b, t=t: fns.prefill.lower(*progs.prefill_args(b, t)),
                               "engine.max_prefill_batch (or engine.prefill_buckets)",
                               dict(tokens=b * t), devices))
    rows = e.max_slots
    per_token = pool_bytes_per_token(progs.cache) if paged else 0
    # With the Pallas kernel XLA's costs do not depend on the attention length (the kernel's
    # own estimate is context-free; the committed 0.5B-7B checks gave the same bytes and
    # FLOPs at 64 and 1,024): one compile, at the largest bucket, and the simulator's point
    # at the smallest is that one plus its pool reads (`report.decode_cost`).
    kernel = paged and progs.kernel.impl != "reference"
    lengths = (cache_l if all_buckets else [cache_l[-1]] if kernel
               else sorted({cache_l[-1], cache_l[0]}, reverse=True))
    for length in lengths:
        kw = dict(cache_len=length, rows=rows) if paged else dict(cache_len=length)
        out.append(Program(f"engine/decode[rows={rows},len={length}]", "sampler",
                           lambda kw=kw: fns.decode.lower(*progs.decode_args(rows), **kw),
                           "engine.kv_budget_tokens (or engine.max_slots, "
                           "engine.tensor_parallel)",
                           dict(steps=e.steps_per_sync, rows=rows, cache_len=length,
                                tokens=e.steps_per_sync * rows,
                                kernel_kv_bytes=rows * length * per_token,
                                kv_bytes_per_token=per_token, shortest_len=cache_l[0]),
                           devices,
                           busy=functools.partial(busy_decode, length=length,
                                                  steps=e.steps_per_sync)))
    decode = [p for p in out if p.name.startswith("engine/decode")]
    out.append(_reshard(cfg, mc, progs, devices, resident=decode[0].name))
    return out


def pool_bytes_per_token(cache) -> float:
    """One chip's bytes of the paged KV pool per token of context, every layer's K and V (its
    shard of the stored heads, padding included): what the paged attention kernel reads per
    context token of a row. XLA counts a Mosaic kernel's traffic from the kernel's own cost
    estimate, which does not grow with the context, so a decode's `work.kernel_kv_bytes`
    (rows x attention length x this, what a step reads at most) is added to its compiled
    bytes where the kernel runs (`report.estimates`)."""
    pools = list(cache.kv)
    per_chip = sum(math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in pools)
    return per_chip / (pools[0].shape[0] * pools[0].shape[1])


def busy_decode(args, *, length: int, steps: int):
    """Decode arguments `(params, cache, slots, refill_at[, tables])` with every slot active at
    position `length - steps - 1` (so its chunk reads up to `length` positions), sampling
    without limit, and (paged) each row holding its own pages."""
    params, cache, slots, refill_at, *tables = args
    placement = jax.tree.map(lambda x: x.sharding, slots)
    ones = lambda x, v: jnp.full(x.shape, v, x.dtype)  # noqa: E731
    slots = slots._replace(
        active=ones(slots.active, True), pos=ones(slots.pos, max(length - steps - 1, 0)),
        rows=slots.rows._replace(limit=ones(slots.rows.limit, 1 << 30),
                                 temperature=ones(slots.rows.temperature, 1.0),
                                 top_p=ones(slots.rows.top_p, 1.0)))
    if tables:
        t = tables[0]
        pool_pages = jax.tree.leaves(cache)[0].shape[0]
        own = (jnp.arange(t.size, dtype=t.dtype) % pool_pages).reshape(t.shape)
        tables = [jax.device_put(own, t.sharding)]
    return (params, cache, jax.device_put(slots, placement), refill_at, *tables)


def _reshard(cfg, mc, progs, devices, resident: str) -> Program:
    """A weight update into the engine's shardings (module docstring). Under LoRA a version
    is the adapters alone (the engine keeps its base, `JaxEngine._install`): only they move."""
    src_dtype = publish_dtype(cfg) or dtype_of(cfg.model.param_dtype)
    n = len(devices)
    shape = tuple(cfg.mesh.shape) if math.prod(cfg.mesh.shape) == n else (1, n, 1)
    src_mesh = sharding_lib.make_mesh(shape, devices)
    spec = lora_spec(cfg)

    def build():
        m = Decoder(mc.replace(param_dtype=src_dtype, dtype=src_dtype), nnx.Rngs(0))
        return m if spec is None else add_lora(m, spec, nnx.Rngs(1))
    abstract = nnx.state(nnx.eval_shape(build))
    src = sharding_lib.state_shardings(abstract, src_mesh)
    moved = _leaves(abstract, spec is not None)
    src, dst = _leaves(src, spec is not None), _leaves(progs.param_shardings, spec is not None)
    args = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=src[k]) for k, a in moved.items()}
    dst_dtype = dtype_of(cfg.engine.dtype)
    fn = jax.jit(lambda p: {k: x.astype(dst_dtype) for k, x in p.items()},
                 out_shardings={k: dst[k] for k in moved})
    return Program("engine/reshard", "sampler", lambda: fn.lower(args),
                   "engine.tensor_parallel (or engine.kv_budget_tokens)",
                   dict(params=sum(math.prod(a.shape) for a in moved.values()),
                        source_mesh=shape, kind="lora adapters" if spec else "full"),
                   devices, resident_from=resident)


def _leaves(state, adapters_only: bool) -> dict:
    """{name: leaf value} of an nnx state, only the LoRA adapters' when `adapters_only`."""
    return {k: v for k, v in flat_params(state, host=False).items()
            if not adapters_only or is_adapter_name(k)}


def default_device(devices: Sequence):
    """The context every lowering runs in: Pallas TPU kernels read the default device's
    chip (Mosaic's `tpu_info`), which must be a TPU topology device, not the CPU host."""
    return jax.default_device(devices[0])


def validate(cfg):
    """The sections the programs are built from, each bad key a `ConfigError` naming it,
    before anything compiles; returns `cfg` with the engine's context filled in (the run's own checks; the tokenizer and task, which compile
    nothing, are left to `run_config.validate` at launch)."""
    from pipelinerl_jax.losses import validate_loss_config
    from pipelinerl_jax.models.factory import validate_model_config
    from pipelinerl_jax.models.lora import validate_lora_config
    from pipelinerl_jax.rollout.jax_engine import validate_engine_config
    from pipelinerl_jax.run_config import (validate_context, validate_learner_batch,
                                           with_contexts)
    validate_model_config(cfg.model, "model")
    validate_lora_config(cfg.lora, "lora")
    validate_context(cfg)
    cfg = with_contexts(cfg)
    validate_engine_config(cfg.engine, "engine")
    validate_loss_config(cfg.loss)
    validate_learner_batch(cfg)
    return cfg
