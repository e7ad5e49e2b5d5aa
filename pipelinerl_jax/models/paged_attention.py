"""A paged KV cache, stored in the TPU ragged paged attention kernel's own layout, and the
reference (pure JAX) paged attention over it.

Layout (names as in `model.py`; p pages, n a sequence's page-table width, c page size):

    pool    `[P, C, 2K', X']` per layer, keys and values in ONE array, interleaved on the head
            axis (key of stored head j at 2j, its value at 2j+1): page-major, then the
            position within the page. This is the layout of JAX's TPU ragged paged attention
            kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), so that kernel
            reads the pool as it is: no gather, no copy before a call. `X'` is head_dim,
            padded to the kernel's 128 lanes where that kernel runs (`padded_head_dim`); `K'`
            the stored kv heads (`stored_kv_heads`): the model's K, or, on an engine mesh
            whose tensor axis exceeds K, one copy of its kv head per tensor shard (vLLM's
            replication), so every shard holds the kv heads its query heads read;
    table   `[B, N]` int32 per sequence: table[b, i] is the page holding positions
            `[i*C, (i+1)*C)` of sequence b; entries of pages a sequence does not hold are
            `P` (out of range): writes there are dropped, reads clamp to some real page and
            are masked by position.

A sequence's positions are contiguous in its *logical* view (page i of the table, then
position within the page), so attention stays "causal by position": the key at view index j
is position j, visible to a query at position q when j <= q. Pages beyond a sequence's
length hold junk (another sequence's data, or this one's padding) and are exactly the
positions the mask hides.

`paged_attention` is the one function that reads pages; its `kernel` argument (a resolved
`engine.attention_kernel`, `models/paged_kernels.py`) picks a Pallas kernel or the reference
below, which gathers the sequence's first `n_pages` pages into a dense view (one copy of
what it reads per call) and attends over its key and value halves. `write_pages` is the
matching scatter. `Decoder.hidden_states` takes a `PagedKVCache` where it takes a dense
`KVCache`.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import paged_kernels


class PagedKVCache(NamedTuple):
    """Per-layer page pools `[P, C, 2K', X']` (a tuple, one array per layer; module
    docstring) and the batch's page tables `[B, N]` (None where the caller passes tables per
    call, as the engine does)."""
    kv: tuple
    page_table: Optional[jax.Array] = None

    @property
    def page_size(self) -> int:
        return self.kv[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.kv[0].shape[0]


LANES = 128  # the TPU kernel's lane width: its head_dim is a multiple of it


def stored_kv_heads(num_kv_heads: int, tensor: int = 1) -> int:
    """K': the kv heads a pool stores on an engine mesh whose `tensor` axis splits the heads.
    `tensor` <= K and dividing it: K (each shard holds K / tensor heads); `tensor` > K and a
    multiple of it: `tensor` (each shard one copy of the kv head its query heads read)."""
    if num_kv_heads % tensor == 0:
        return num_kv_heads
    if tensor % num_kv_heads == 0:
        return tensor
    raise ValueError(f"a tensor axis of {tensor} neither divides nor is a multiple of the "
                     f"model's {num_kv_heads} kv heads")


def padded_head_dim(head_dim: int, lanes: int = 1) -> int:
    """X': head_dim rounded up to a multiple of `lanes` (`LANES` for the TPU kernel)."""
    return -(-head_dim // lanes) * lanes


def init_paged_cache(cfg, num_pages: int, page_size: int, page_table=None, dtype=None,
                     kv_heads: Optional[int] = None, head_dim: Optional[int] = None
                     ) -> PagedKVCache:
    """Zero pools of `num_pages` pages of `page_size` tokens per layer, storing `kv_heads`
    (K', default the model's K) heads of `head_dim` (X', default the model's) lanes."""
    dtype = dtype or cfg.dtype
    shape = (num_pages, page_size, 2 * (kv_heads or cfg.num_kv_heads),
             head_dim or cfg.head_dim)
    return PagedKVCache(kv=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                        page_table=page_table)


def interleave(k_btkx, v_btkx, pool):
    """Keys and values `[B, T, K, X]` as rows of `pool`'s layout `[B, T, 2K', X']`: each kv
    head repeated K'/K times (copies of one head side by side), k and v interleaved,
    head_dim zero-padded to X'."""
    heads, width = pool.shape[2] // 2, pool.shape[3]
    rep = heads // k_btkx.shape[2]
    kv = jnp.stack([k_btkx.astype(pool.dtype), v_btkx.astype(pool.dtype)], axis=3)
    kv = jnp.repeat(kv, rep, axis=2) if rep > 1 else kv  # [B, T, K', 2, X]
    kv = kv.reshape(*kv.shape[:2], 2 * heads, kv.shape[-1])
    pad = width - kv.shape[-1]
    return jnp.pad(kv, [(0, 0)] * 3 + [(0, pad)]) if pad else kv


def kv_pool(pool_k, pool_v, kv_heads: Optional[int] = None, head_dim: Optional[int] = None):
    """The pool `[P, C, 2K', X']` holding separate key and value pools `[P, C, K, X]`."""
    p, c, k, x = pool_k.shape
    like = jax.ShapeDtypeStruct((p, c, 2 * (kv_heads or k), head_dim or x), pool_k.dtype)
    return interleave(pool_k, pool_v, like)


def split_kv(view, head_dim: int):
    """Keys and values `[..., K', X]` of a view `[..., 2K', X']` in the pool's layout."""
    return view[..., 0::2, :head_dim], view[..., 1::2, :head_dim]


def page_slots(page_table_bn, positions_bt, page_size: int, num_pages: int):
    """(page `[B, T]`, offset `[B, T]`) where each position's K/V lives; positions past the
    table (or in a page the sequence does not hold) map to page `num_pages` (dropped)."""
    n = page_table_bn.shape[1]
    col = positions_bt // page_size
    page = jnp.take_along_axis(page_table_bn, jnp.clip(col, 0, n - 1), axis=1)
    page = jnp.where((col >= 0) & (col < n), page, num_pages)
    return page, positions_bt % page_size


def write_pages(pool, page_table_bn, positions_bt, k_btkx, v_btkx):
    """`pool` with keys and values `[B, T, K, X]` written at each row's `positions_bt`
    through its page table (writes to pages out of range are dropped)."""
    page, off = page_slots(page_table_bn, positions_bt, pool.shape[1], pool.shape[0])
    return pool.at[page, off].set(interleave(k_btkx, v_btkx, pool), mode="drop")


def gather_pages(pool, page_table_bn, n_pages: int):
    """The logical view `[B, n_pages*C, 2K', X']` of each row's first `n_pages` pages."""
    b = page_table_bn.shape[0]
    pages = jnp.take(pool, page_table_bn[:, :n_pages], axis=0, mode="clip")  # [B, n, C, ...]
    return pages.reshape(b, n_pages * pool.shape[1], *pool.shape[2:])


def paged_attention(q_bthx, pool, page_table_bn, positions_bt, n_pages: Optional[int] = None,
                    kernel="reference"):
    """Attention of queries `[B, T, H, X]` at `positions_bt` over each row's KV pages in
    `pool` (`[P, C, 2K', X']`), causal by position; returns `[B, T, H, X]` in the query dtype.

    Reads the first `n_pages` (static; default: the whole table) pages of each row, which
    must cover every query position. GQA: query head h reads stored kv head h // (H/K').
    Numerics follow the dense cached forward (float32 scores and softmax). `kernel`
    (static): one of `paged_kernels.IMPLS` or a `paged_kernels.AttentionKernel`; a kernel
    that does not serve the call (the GPU one for T > 1) leaves it to the reference."""
    n_pages = page_table_bn.shape[1] if n_pages is None else n_pages
    kernel = paged_kernels.as_kernel(kernel)
    if kernel.impl != "reference":
        out = paged_kernels.kernel_attention(kernel, q_bthx, pool, page_table_bn,
                                             positions_bt, n_pages)
        if out is not None:
            return out
    b, t, h, x = q_bthx.shape
    k_heads = pool.shape[2] // 2
    g = h // k_heads
    dt = q_bthx.dtype
    # The gathered view in the dense engine's layout (`rollout/decode_step.py`): keys
    # [B, K, X, S], values [B, K, S, X], the batch and kv-head dimensions leading, so both
    # products are plain batched matrix products whose contraction is a major dimension.
    # The T queries of a kv head's G query heads are one [T*G, X] block.
    keys, values = split_kv(gather_pages(pool, page_table_bn, n_pages), x)
    keys_bkxs = jnp.transpose(keys, (0, 2, 3, 1)).astype(dt)
    values_bksx = jnp.transpose(values, (0, 2, 1, 3)).astype(dt)
    s = keys_bkxs.shape[-1]
    q_bkmx = jnp.transpose(q_bthx.reshape(b, t, k_heads, g, x),
                           (0, 2, 1, 3, 4)).reshape(b, k_heads, t * g, x)
    scores = jnp.einsum("bkmx,bkxs->bkms", q_bkmx, keys_bkxs).astype(jnp.float32)
    scores = scores.reshape(b, k_heads, t, g, s) / math.sqrt(x)
    visible = jnp.arange(s)[None, None, :] <= positions_bt[:, :, None]  # [b, t, s]
    scores = jnp.where(visible[:, None, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(b, k_heads, t * g, s)
    out = jnp.einsum("bkms,bksx->bkmx", probs, values_bksx)
    return jnp.transpose(out.reshape(b, k_heads, t, g, x), (0, 2, 1, 3, 4)).reshape(b, t, h, x)
