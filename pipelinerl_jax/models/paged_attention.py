"""A paged KV cache and the reference (pure JAX) paged attention.

Layout (names as in `model.py`; p pages, n a sequence's page-table width, c page size):

    pool    `[P, C, K, X]` per layer, keys and values alike: page-major, then the position
            within the page, then kv heads and head_dim (the layout of JAX's ragged paged
            attention kernel and of sglang-jax: one page is one contiguous block, and one
            token's K or V is one contiguous `[K, X]` row, so a decode step writes each row's
            new token with one small scatter);
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
`engine.attention_kernel`, `models/paged_kernels.py`) picks a Pallas kernel (TPU ragged
paged attention, GPU Triton paged attention) or the reference below, which gathers the
sequence's first `n_pages` pages into a dense view and attends over it, so its cost is one
copy of the keys and values it reads per call. The view is laid out as the dense engine's
decode cache is (keys `[B, K, X, S]`, values `[B, K, S, X]`, `rollout/decode_step.py`): on
XLA:CPU the gather and that transpose fuse into one pass and the two products need no
further copy of keys, values, queries or probabilities. `write_pages` is the matching
scatter. `Decoder.hidden_states` takes a `PagedKVCache` where it takes a dense `KVCache`.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pipelinerl_jax.models import paged_kernels


class PagedKVCache(NamedTuple):
    """Per-layer page pools `[P, C, K, X]` (tuples, one array per layer) and the batch's page
    tables `[B, N]` (None where the caller passes tables per call, as the engine does)."""
    k: tuple
    v: tuple
    page_table: Optional[jax.Array] = None

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]


def init_paged_cache(cfg, num_pages: int, page_size: int, page_table=None,
                     dtype=None) -> PagedKVCache:
    """Zero pools of `num_pages` pages of `page_size` tokens per layer."""
    dtype = dtype or cfg.dtype
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return PagedKVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                        page_table=page_table)


def page_slots(page_table_bn, positions_bt, page_size: int, num_pages: int):
    """(page `[B, T]`, offset `[B, T]`) where each position's K/V lives; positions past the
    table (or in a page the sequence does not hold) map to page `num_pages` (dropped)."""
    n = page_table_bn.shape[1]
    col = positions_bt // page_size
    page = jnp.take_along_axis(page_table_bn, jnp.clip(col, 0, n - 1), axis=1)
    page = jnp.where((col >= 0) & (col < n), page, num_pages)
    return page, positions_bt % page_size


def write_pages(pool, page_table_bn, positions_bt, new_btkx):
    """`pool` with `new_btkx` `[B, T, K, X]` written at each row's `positions_bt` through its
    page table (writes to pages out of range are dropped)."""
    page, off = page_slots(page_table_bn, positions_bt, pool.shape[1], pool.shape[0])
    return pool.at[page, off].set(new_btkx.astype(pool.dtype), mode="drop")


def gather_pages(pool, page_table_bn, n_pages: int):
    """The logical view `[B, n_pages*C, K, X]` of each row's first `n_pages` pages."""
    b = page_table_bn.shape[0]
    pages = jnp.take(pool, page_table_bn[:, :n_pages], axis=0, mode="clip")  # [B, n, C, K, X]
    return pages.reshape(b, n_pages * pool.shape[1], *pool.shape[2:])


def paged_attention(q_bthx, pool_k, pool_v, page_table_bn, positions_bt,
                    n_pages: Optional[int] = None, kernel: str = "reference"):
    """Attention of queries `[B, T, H, X]` at `positions_bt` over each row's KV pages, causal
    by position; returns `[B, T, H, X]` in the query dtype.

    Reads the first `n_pages` (static; default: the whole table) pages of each row, which
    must cover every query position. GQA: query head h reads kv head h // (H/K). Numerics
    follow the dense cached forward (float32 scores and softmax). `kernel` (static): one of
    `paged_kernels.IMPLS`; a kernel that does not serve the call (the GPU one for T > 1)
    leaves it to the reference."""
    n_pages = page_table_bn.shape[1] if n_pages is None else n_pages
    if kernel != "reference":
        out = paged_kernels.kernel_attention(kernel, q_bthx, pool_k, pool_v, page_table_bn,
                                             positions_bt, n_pages)
        if out is not None:
            return out
    b, t, h, x = q_bthx.shape
    k_heads = pool_k.shape[2]
    g = h // k_heads
    dt = q_bthx.dtype
    # The gathered view in the dense engine's layout (`rollout/decode_step.py`): keys
    # [B, K, X, S], values [B, K, S, X], the batch and kv-head dimensions leading, so both
    # products are plain batched matrix products whose contraction is a major dimension;
    # XLA fuses each transpose into its gather (one pass over what is read). The T queries
    # of a kv head's G query heads are one [T*G, X] block (free reshapes for T = 1).
    keys_bkxs = jnp.transpose(gather_pages(pool_k, page_table_bn, n_pages),
                              (0, 2, 3, 1)).astype(dt)
    values_bksx = jnp.transpose(gather_pages(pool_v, page_table_bn, n_pages),
                                (0, 2, 1, 3)).astype(dt)
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
