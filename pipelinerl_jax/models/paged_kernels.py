"""The Pallas kernels behind `paged_attention`, and how our call becomes theirs.

`engine.attention_kernel` picks the implementation of `models.paged_attention.paged_attention`:

    'reference'  the pure-JAX gather + attention (any backend; the oracle);
    'pallas'     a Pallas kernel: on TPU JAX's ragged paged attention (decode and T > 1; on
                 one device or, under `shard_map`, per shard of an engine mesh), on GPU JAX's
                 Triton paged attention (decode only, one device: T > 1 stays on the
                 reference); on CPU the Triton kernel in Pallas interpret mode (a slow
                 correctness check: the TPU kernel does not run in interpret mode on CPU in
                 JAX 0.10.2, see tests/models/test_paged_kernels.py);
    'auto'       'pallas' on TPU and on one GPU device, 'reference' on CPU or several GPUs.

TPU ragged. The pool is stored in this kernel's layout (`[P, C, 2K', X']`, K and V interleaved
on the head axis, X' a multiple of 128: `paged_attention.py`), so the call hands it the pool
and the page tables as they are: no gather, no copy of the keys and values. Queries are
flattened `[sum T, H, X']` with cumulative lengths; causal as "the row's T queries are its last
T positions" (`kv_len - T + t`). On a mesh (`AttentionKernel.mesh`) the kernel runs per shard
under `shard_map`: queries split on their heads and the pool on its stored heads over the
`tensor` axis (shard i holds query heads [iH/t, (i+1)H/t) and stored kv heads
[iK'/t, (i+1)K'/t), which are exactly the heads those queries read), tables and lengths
replicated; every other mesh axis holds a replica.

GPU Triton wants keys and values `[K, P, C, X]` (head-major) apart, one query per row,
`lengths` (key j visible when j < length), no softmax scale (q is pre-scaled): its adapter
gathers each row's first `n_pages` pages into a compact pool of `B·n_pages` pages in that
layout (one copy of what the call reads, as the reference's gather).

Entries a row does not hold (`P`, out of range) are clamped like the reference's reads, and
lengths are capped at `n_pages·C` (inactive decode rows sit past every table).

Semantics we need from a kernel: causal by position, GQA (query head h reads kv head
h // (H/K)), float32 softmax. For T > 1 the kernels' causal rule equals ours when each row's
positions are consecutive (`positions[b, t] = positions[b, 0] + t`), which is what the
model's cached forward passes; decode (T = 1) has no such condition.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

ATTENTION_KERNELS = ("auto", "reference", "pallas")
# resolved implementations (`resolve_attention_kernel`)
IMPLS = ("reference", "tpu_ragged", "gpu_paged", "gpu_paged_interpret")


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """A resolved implementation (one of IMPLS), the mesh it runs per shard of (None: one
    device), and the TPU kernel's block sizes as `((name, value), ...)` (empty: its own
    tuned table, which reads the default device; an ahead-of-time compile for a TPU
    topology from a CPU host passes them)."""
    impl: str = "reference"
    mesh: Optional[Any] = None
    block_sizes: tuple = ()


def as_kernel(kernel) -> AttentionKernel:
    """`kernel` (an implementation name or an `AttentionKernel`) as an `AttentionKernel`."""
    if isinstance(kernel, AttentionKernel):
        return kernel
    if kernel not in IMPLS:
        raise ValueError(f"unknown attention implementation {kernel!r} (one of {IMPLS})")
    return AttentionKernel(kernel)


def resolve_attention_kernel(name: str, platform: str, num_devices: int = 1) -> str:
    """The implementation (one of IMPLS) that `name` (one of ATTENTION_KERNELS) means on
    `platform` ('cpu', 'gpu' / 'cuda' / 'rocm', 'tpu') over `num_devices` devices."""
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel must be one of {ATTENTION_KERNELS}, got {name!r}")
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if name == "reference" or (name == "auto" and (
            platform == "cpu" or (platform != "tpu" and num_devices > 1))):
        return "reference"
    if platform == "tpu":
        return "tpu_ragged"
    if num_devices > 1:
        raise ValueError(f"the GPU Pallas kernel runs on one device, the engine has "
                         f"{num_devices}")
    return "gpu_paged" if platform == "gpu" else "gpu_paged_interpret"


def _kv_lengths(positions_bt, n_pages: int, page_size: int):
    """Keys each row attends to: its last query's position + 1, at most what it reads."""
    return jnp.minimum(positions_bt[:, -1] + 1, n_pages * page_size).astype(jnp.int32)


# ---- TPU: jax.experimental.pallas.ops.tpu.ragged_paged_attention -------------------------

def tpu_ragged_args(q_bthx, pool, page_table_bn, positions_bt, n_pages: int):
    """The ragged kernel's positional arguments `(queries, kv_pages, kv_lens, page_indices,
    cu_q_lens, num_seqs)` and its `sm_scale`, for our call: `kv_pages` is `pool` itself."""
    b, t, h, x = q_bthx.shape
    xp = pool.shape[-1]
    queries = jnp.pad(q_bthx.reshape(b * t, h, x), [(0, 0), (0, 0), (0, xp - x)])
    kv_lens = _kv_lengths(positions_bt, n_pages, pool.shape[1])
    page_indices = jnp.minimum(page_table_bn[:, :n_pages], pool.shape[0] - 1)
    cu_q_lens = (jnp.arange(b + 1) * t).astype(jnp.int32)
    num_seqs = jnp.array([b], jnp.int32)
    return (queries, pool, kv_lens, page_indices, cu_q_lens, num_seqs), 1.0 / math.sqrt(x)


def tpu_ragged_output(out, q_bthx):
    """The kernel's `[B·T, H, X']` output as our `[B, T, H, X]`."""
    b, t, h, x = q_bthx.shape
    return out[:, :, :x].reshape(b, t, h, x).astype(q_bthx.dtype)


def tpu_ragged_attention(q_bthx, pool, page_table_bn, positions_bt, n_pages: int,
                         mesh=None, **block_sizes):
    """`paged_attention` through JAX's TPU ragged paged attention kernel (decode and T > 1),
    per shard of `mesh` under `shard_map` when given (module docstring). `block_sizes`: the
    kernel's `num_kv_pages_per_block` / `num_queries_per_block` (default: its tuned table)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    args, scale = tpu_ragged_args(q_bthx, pool, page_table_bn, positions_bt, n_pages)

    def kernel(*a):
        return ragged_paged_attention(*a, sm_scale=scale, **block_sizes)
    if mesh is not None and mesh.size > 1:
        heads = P(None, "tensor")  # queries / output on H, the pool on 2K'
        kernel = jax.shard_map(kernel, mesh=mesh, check_vma=False,
                               in_specs=(heads, P(None, None, "tensor"), P(), P(), P(), P()),
                               out_specs=heads)
    return tpu_ragged_output(kernel(*args), q_bthx)


# ---- GPU: jax.experimental.pallas.ops.gpu.paged_attention (decode only) ------------------

def gpu_paged_args(q_bthx, pool, page_table_bn, positions_bt, n_pages: int):
    """The Triton kernel's arguments `(q, k_pages, v_pages, block_tables, lengths)` for a
    decode call (T = 1), q pre-scaled by 1/sqrt(head_dim)."""
    b, t, h, x = q_bthx.shape
    if t != 1:
        raise ValueError(f"the GPU paged attention kernel is decode-only (T = 1), got T = {t}")
    c, k_heads = pool.shape[1], pool.shape[2] // 2
    pages = jnp.take(pool, page_table_bn[:, :n_pages], axis=0, mode="clip")  # [B, n, C, 2K, X']

    def head_major(half):  # [B, n, C, K, X] -> [K, B*n, C, X]
        return jnp.moveaxis(half, 3, 0).reshape(k_heads, b * n_pages, c, x)
    q = (q_bthx[:, 0].astype(jnp.float32) / math.sqrt(x)).astype(q_bthx.dtype)
    tables = jnp.arange(b * n_pages, dtype=jnp.int32).reshape(b, n_pages)
    return (q, head_major(pages[..., 0::2, :x]), head_major(pages[..., 1::2, :x]), tables,
            _kv_lengths(positions_bt, n_pages, c))


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def gpu_paged_attention(q_bthx, pool, page_table_bn, positions_bt, n_pages: int,
                        interpret: bool = False):
    """`paged_attention` for T = 1 through JAX's Triton paged attention kernel (`interpret`:
    Pallas interpret mode, which runs on CPU)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel
    k_splits = _largest_divisor(n_pages, 16)  # the kernel's split of a row's pages
    per_block = _largest_divisor(n_pages // k_splits, 8)
    out = kernel(*gpu_paged_args(q_bthx, pool, page_table_bn, positions_bt, n_pages),
                 k_splits=k_splits, pages_per_compute_block=per_block, interpret=interpret)
    return out[:, None].astype(q_bthx.dtype)


def kernel_attention(kernel: AttentionKernel, q_bthx, pool, page_table_bn, positions_bt,
                     n_pages: int):
    """`paged_attention` through `kernel` (not 'reference'); None where it does not serve
    this call (GPU kernels and T > 1): the caller runs the reference."""
    if kernel.impl == "tpu_ragged":
        return tpu_ragged_attention(q_bthx, pool, page_table_bn, positions_bt, n_pages,
                                    kernel.mesh, **dict(kernel.block_sizes))
    if kernel.impl in ("gpu_paged", "gpu_paged_interpret"):
        if q_bthx.shape[1] != 1:
            return None
        return gpu_paged_attention(q_bthx, pool, page_table_bn, positions_bt, n_pages,
                                   interpret=kernel.impl == "gpu_paged_interpret")
    raise ValueError(f"unknown attention implementation {kernel.impl!r} (one of {IMPLS})")
