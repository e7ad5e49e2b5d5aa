"""One decode step (one new token per row) over the model's parameters, specialised for T = 1.

`Decoder.__call__(ids, positions, cache)` serves any T; its attention is a pair of batched
dot products over `[B, S, K, X]` caches. For T = 1 each (row, kv head) is a matrix-vector
product, and XLA:CPU lowers that batched dot by first transposing the whole cache so the
batch dimensions lead — a copy of every layer's K and V per step. The engine instead keeps
its own cache layout, batch and head dimensions first, so both attention products are
plain batched matrix products over contiguous blocks without any transpose:

    keys   `[B, K, X, S]`   scores = q_bkgx · keys_bkxs      (contraction over the major X)
    values `[B, K, S, X]`   out    = probs_bkgs · values_bksx (contraction over the major S)

(keys are stored transposed because a contraction over the minor dimension of the right
operand was 3-4× slower on XLA:CPU). Measured per layer, attention alone (2-core EPYC):
100M config B=32 S=512: 34.6 ms through the model path, ~2 ms here. Attention reads only the
first `cache_len` positions (a static slice), and the step's K/V are scattered into the full
cache in place.

Everything else (projections, RoPE, norms, MLP, logits) is the model's own code, called
through its public pieces, so numerics match the cached forward to float32 rounding (the
engine tests compare engine log-probs with the full forward within 1e-4).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from pipelinerl_jax.models import Decoder, KVCache
from pipelinerl_jax.models.model import rope_frequencies
from pipelinerl_jax.models.paged_attention import paged_attention, write_pages


def _attention(attn, x_bd, pos_b, inv_freq, ck, cv, cache_len: int):
    """One layer's attention for one token per row; returns (out `[B, D]`, ck, cv)."""
    cfg, dt = attn.cfg, attn.cfg.dtype
    b = x_bd.shape[0]
    k_heads, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    q, k, v = attn.project(x_bd[:, None], pos_b[:, None], inv_freq)

    rows = jnp.arange(b)
    ck = ck.at[rows, :, :, pos_b].set(k[:, 0].astype(ck.dtype), mode="drop")  # [B, K, X, S]
    cv = cv.at[rows, :, pos_b].set(v[:, 0].astype(cv.dtype), mode="drop")  # [B, K, S, X]
    keys_bkxs = ck[:, :, :, :cache_len].astype(dt)
    values_bksx = cv[:, :, :cache_len].astype(dt)

    q_bkgx = q[:, 0].reshape(b, k_heads, g, cfg.head_dim)
    scores_bkgs = jnp.einsum("bkgx,bkxs->bkgs", q_bkgx, keys_bkxs).astype(jnp.float32)
    scores_bkgs = scores_bkgs / math.sqrt(cfg.head_dim)
    visible_bs = jnp.arange(cache_len)[None, :] <= pos_b[:, None]  # causal by position
    scores_bkgs = jnp.where(visible_bs[:, None, None, :], scores_bkgs,
                            jnp.finfo(jnp.float32).min)
    scores_bkgs = scores_bkgs - jnp.max(scores_bkgs, axis=-1, keepdims=True)
    weights_bkgs = jnp.exp(scores_bkgs)
    probs_bkgs = (weights_bkgs / jnp.sum(weights_bkgs, axis=-1, keepdims=True)).astype(dt)
    out_bkgx = jnp.einsum("bkgs,bksx->bkgx", probs_bkgs, values_bksx)
    return attn.output(out_bkgx.reshape(b, cfg.num_heads, cfg.head_dim)), ck, cv


def _paged_attention(attn, x_bd, pos_b, inv_freq, pool, tables_bn, n_pages: int,
                     kernel="reference"):
    """`_attention` over a paged cache: the step's K/V go to each row's page for `pos_b`
    (rows whose position is past their table write nowhere), then `paged_attention` reads
    the first `n_pages` pages of each row through `kernel` (`models/paged_kernels.py`)."""
    cfg = attn.cfg
    b = x_bd.shape[0]
    q, k, v = attn.project(x_bd[:, None], pos_b[:, None], inv_freq)
    pool = write_pages(pool, tables_bn, pos_b[:, None], k, v)
    out = paged_attention(q, pool, tables_bn, pos_b[:, None], n_pages, kernel)
    return attn.output(out[:, 0].reshape(b, cfg.num_heads, cfg.head_dim)), pool


def init_engine_cache(cfg, batch: int, max_len: int, dtype=None) -> KVCache:
    """A zero cache in the engine layout: per layer keys `[B, K, X, S]`, values `[B, K, S, X]`."""
    dtype = dtype or cfg.dtype
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(k=tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)))


def write_rows(cache: KVCache, model_cache: KVCache, rows_b) -> KVCache:
    """Copies a model-layout cache `[Bp, T, K, X]` (a prefill's) into positions `[0, T)` of
    the engine-layout cache rows `rows_b`; rows out of range are dropped (padding)."""
    t = model_cache.k[0].shape[1]

    def keys(big, small):
        return big.at[rows_b, :, :, :t].set(
            jnp.transpose(small, (0, 2, 3, 1)).astype(big.dtype), mode="drop")

    def values(big, small):
        return big.at[rows_b, :, :t].set(jnp.swapaxes(small, 1, 2).astype(big.dtype),
                                         mode="drop")
    return KVCache(tuple(map(keys, cache.k, model_cache.k)),
                   tuple(map(values, cache.v, model_cache.v)))


def decode_logits(model: Decoder, token_b, pos_b, cache: KVCache, cache_len: int,
                  tables_bn=None, kernel: str = "reference"):
    """Logits `[B, V]` (float32) of the next token after feeding `token_b` at `pos_b`, and the
    engine-layout cache with this step's K/V written at `pos_b` (positions >= the cache size
    are dropped).
    Attention covers cache positions `< cache_len` (static), which must exceed every
    `pos_b` of a row whose output is used.
    With `tables_bn` (`[B, N]` page tables) `cache` holds page pools (`PagedKVCache` layout,
    `[P, C, 2K', X']` per layer) and attention reads each row's first `ceil(cache_len / C)`
    pages through `kernel` (a resolved `engine.attention_kernel`, `models/paged_kernels.py`)."""
    cfg = model.cfg
    inv_freq = rope_frequencies(cfg)
    h_bd = jnp.take(model.embed[...], token_b, axis=0).astype(cfg.dtype)
    new = []  # per layer: (keys, values), or the page pool
    for i, layer in enumerate(model.layers):
        if tables_bn is None:
            a, ck, cv = _attention(layer.attn, layer.input_norm(h_bd), pos_b, inv_freq,
                                   cache.k[i], cache.v[i], cache_len)
            new.append((ck, cv))
        else:
            page = cache.kv[i].shape[1]
            n_pages = min(-(-cache_len // page), tables_bn.shape[1])
            a, pool = _paged_attention(layer.attn, layer.input_norm(h_bd), pos_b, inv_freq,
                                       cache.kv[i], tables_bn, n_pages, kernel)
            new.append(pool)
        h_bd = h_bd + a.astype(h_bd.dtype)
        h_bd = h_bd + layer.mlp(layer.post_attn_norm(h_bd)).astype(h_bd.dtype)
    logits = model.logits_from_hidden(model.final_norm(h_bd))
    if tables_bn is not None:
        return logits, cache._replace(kv=tuple(new))
    return logits, cache._replace(k=tuple(c[0] for c in new), v=tuple(c[1] for c in new))
