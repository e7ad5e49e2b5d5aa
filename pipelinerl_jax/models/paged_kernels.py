"""The Pallas kernels behind `paged_attention`, and the adapters from our layout to theirs.

`engine.attention_kernel` picks the implementation of `models.paged_attention.paged_attention`:

    'reference'  the pure-JAX gather + attention (any backend; the oracle);
    'pallas'     a Pallas kernel: on TPU JAX's ragged paged attention (decode and T > 1), on
                 GPU JAX's Triton paged attention (decode only: T > 1 stays on the reference);
                 on CPU the Triton kernel in Pallas interpret mode (a slow correctness check:
                 the TPU kernel does not run in interpret mode on CPU in JAX 0.10.2, see
                 tests/models/test_paged_kernels.py);
    'auto'       'pallas' on one TPU or GPU device, 'reference' on CPU or over several devices
                 (a `pallas_call` is one device's program; ours are not wrapped in shard_map).

Both kernels want their own cache layout, not ours (`[P, C, K, X]` keys and values apart):

    TPU ragged   one pool `[P, C, 2K, X']`, K and V interleaved on the head axis (k at even,
                 v at odd), head_dim padded to a multiple of 128 (the kernel's lane width);
                 queries flattened `[sum T, H, X']` with cumulative lengths, causal as "the
                 row's T queries are its last T positions" (`kv_len - T + t`);
    GPU Triton   keys and values `[K, P, C, X]` (head-major), one query per row, `lengths`
                 (key j visible when j < length), no softmax scale (q is pre-scaled).

The adapters below gather each row's first `n_pages` pages into a compact pool of `B·n_pages`
pages in the kernel's layout (page table: `arange`), so their cost is one copy of what the
call reads — the same as the reference's gather, never the whole pool. Storing the pool in a
kernel's layout would remove that copy; it is not done (one layout serves every backend).
Entries a row does not hold (`P`, out of range) are clamped like the reference's reads, and
lengths are capped at `n_pages·C` (inactive decode rows sit past every table).

Semantics we need from a kernel: causal by position, GQA (query head h reads kv head
h // (H/K)), float32 softmax. For T > 1 the kernels' causal rule equals ours when each row's
positions are consecutive (`positions[b, t] = positions[b, 0] + t`), which is what the
model's cached forward passes; decode (T = 1) has no such condition.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ATTENTION_KERNELS = ("auto", "reference", "pallas")
# resolved implementations (`resolve_attention_kernel`)
IMPLS = ("reference", "tpu_ragged", "gpu_paged", "gpu_paged_interpret")


def resolve_attention_kernel(name: str, platform: str, num_devices: int = 1) -> str:
    """The implementation (one of IMPLS) that `name` (one of ATTENTION_KERNELS) means on
    `platform` ('cpu', 'gpu' / 'cuda' / 'rocm', 'tpu') over `num_devices` devices."""
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel must be one of {ATTENTION_KERNELS}, got {name!r}")
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if name == "reference" or (name == "auto" and (platform == "cpu" or num_devices > 1)):
        return "reference"
    if num_devices > 1:
        raise ValueError(f"the Pallas kernels run on one device, the engine has {num_devices}")
    return {"tpu": "tpu_ragged", "gpu": "gpu_paged"}.get(platform, "gpu_paged_interpret")


def compact_pages(pool, page_table_bn, n_pages: int):
    """Each row's first `n_pages` pages `[B, n_pages, C, K, X]` (out-of-range entries
    clamped, as the reference reads them)."""
    return jnp.take(pool, page_table_bn[:, :n_pages], axis=0, mode="clip")


def _kv_lengths(positions_bt, n_pages: int, page_size: int):
    """Keys each row attends to: its last query's position + 1, at most what it reads."""
    return jnp.minimum(positions_bt[:, -1] + 1, n_pages * page_size).astype(jnp.int32)


# ---- TPU: jax.experimental.pallas.ops.tpu.ragged_paged_attention -------------------------

def tpu_ragged_args(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages: int):
    """The ragged kernel's positional arguments `(queries, kv_pages, kv_lens, page_indices,
    cu_q_lens, num_seqs)` and its `sm_scale`, for our call (module docstring)."""
    b, t, h, x = q_bthx.shape
    c, k_heads = pool_k.shape[1], pool_k.shape[2]
    xp = -(-x // 128) * 128
    pad = [(0, 0)] * 3 + [(0, xp - x)]
    keys = compact_pages(pool_k, page_table_bn, n_pages).reshape(b * n_pages, c, k_heads, x)
    values = compact_pages(pool_v, page_table_bn, n_pages).reshape(b * n_pages, c, k_heads, x)
    kv = jnp.stack([keys, values.astype(keys.dtype)], axis=3)  # [p, C, K, 2, X]: k, v, k, v
    kv = jnp.pad(kv.reshape(b * n_pages, c, 2 * k_heads, x), pad)
    queries = jnp.pad(q_bthx.reshape(b * t, h, x), pad[1:])
    kv_lens = _kv_lengths(positions_bt, n_pages, c)
    page_indices = jnp.arange(b * n_pages, dtype=jnp.int32).reshape(b, n_pages)
    cu_q_lens = (jnp.arange(b + 1) * t).astype(jnp.int32)
    num_seqs = jnp.array([b], jnp.int32)
    return (queries, kv, kv_lens, page_indices, cu_q_lens, num_seqs), 1.0 / math.sqrt(x)


def tpu_ragged_output(out, q_bthx):
    """The kernel's `[B·T, H, X']` output as our `[B, T, H, X]`."""
    b, t, h, x = q_bthx.shape
    return out[:, :, :x].reshape(b, t, h, x).astype(q_bthx.dtype)


def tpu_ragged_attention(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages: int,
                         **block_sizes):
    """`paged_attention` through JAX's TPU ragged paged attention kernel (decode and T > 1).
    `block_sizes`: the kernel's `num_kv_pages_per_block` / `num_queries_per_block` (default:
    its own tuned table)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    args, scale = tpu_ragged_args(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages)
    return tpu_ragged_output(ragged_paged_attention(*args, sm_scale=scale, **block_sizes),
                             q_bthx)


# ---- GPU: jax.experimental.pallas.ops.gpu.paged_attention (decode only) ------------------

def gpu_paged_args(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages: int):
    """The Triton kernel's arguments `(q, k_pages, v_pages, block_tables, lengths)` for a
    decode call (T = 1), q pre-scaled by 1/sqrt(head_dim)."""
    b, t, h, x = q_bthx.shape
    if t != 1:
        raise ValueError(f"the GPU paged attention kernel is decode-only (T = 1), got T = {t}")
    c, k_heads = pool_k.shape[1], pool_k.shape[2]

    def head_major(pool):  # [B, n, C, K, X] -> [K, B*n, C, X]
        pages = compact_pages(pool, page_table_bn, n_pages)
        return jnp.moveaxis(pages, 3, 0).reshape(k_heads, b * n_pages, c, x)
    q = (q_bthx[:, 0].astype(jnp.float32) / math.sqrt(x)).astype(q_bthx.dtype)
    tables = jnp.arange(b * n_pages, dtype=jnp.int32).reshape(b, n_pages)
    return (q, head_major(pool_k), head_major(pool_v).astype(pool_k.dtype), tables,
            _kv_lengths(positions_bt, n_pages, c))


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def gpu_paged_attention(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages: int,
                        interpret: bool = False):
    """`paged_attention` for T = 1 through JAX's Triton paged attention kernel (`interpret`:
    Pallas interpret mode, which runs on CPU)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel
    k_splits = _largest_divisor(n_pages, 16)  # the kernel's split of a row's pages
    per_block = _largest_divisor(n_pages // k_splits, 8)
    out = kernel(*gpu_paged_args(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages),
                 k_splits=k_splits, pages_per_compute_block=per_block, interpret=interpret)
    return out[:, None].astype(q_bthx.dtype)


def kernel_attention(impl: str, q_bthx, pool_k, pool_v, page_table_bn, positions_bt,
                     n_pages: int):
    """`paged_attention` through resolved implementation `impl` (not 'reference'); None where
    `impl` does not serve this call (GPU kernels and T > 1): the caller runs the reference."""
    if impl == "tpu_ragged":
        return tpu_ragged_attention(q_bthx, pool_k, pool_v, page_table_bn, positions_bt, n_pages)
    if impl in ("gpu_paged", "gpu_paged_interpret"):
        if q_bthx.shape[1] != 1:
            return None
        return gpu_paged_attention(q_bthx, pool_k, pool_v, page_table_bn, positions_bt,
                                   n_pages, interpret=impl == "gpu_paged_interpret")
    raise ValueError(f"unknown attention implementation {impl!r} (one of {IMPLS})")
