"""Flax NNX decoder-only transformer: Llama-3 / Qwen2 / Qwen3.

Layout (shape-suffixed names as in Tunix): b batch, t query positions, s key positions,
d hidden, h query heads, k kv heads, g = h/k query heads per kv head, x head_dim, f mlp.

Every parameter carries its logical axes as Variable metadata (`logical_axes`), and
`pipelinerl_jax.sharding` maps those to mesh axes with one rules table (MaxText style), so a
parallelism change edits the table, never this file.

Two forward paths share all the layers:
  * full forward `model(input_ids)` over right-padded `[B, T]` rows (learner, causal mask);
  * cached forward `model(input_ids, positions=..., cache=...)` that writes this call's
    keys/values at `positions` into a preallocated cache and attends causally *by position*
    (key index <= query position). The cache is dense (`KVCache`, `[B, S, K, X]` per layer)
    or paged (`PagedKVCache`: page pools and per-row page tables, `paged_attention.py`).
    Prefill is a call with T = prompt length, decode a call with T = 1. Padding tokens
    write junk only at positions beyond the sequence, which a later decode step overwrites
    before any query can attend to them.
Numerics follow HF: RMSNorm and softmax in float32, RoPE with rotate-half.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pipelinerl_jax.models.decoder_config import ModelConfig
from pipelinerl_jax.models.paged_attention import PagedKVCache, paged_attention, write_pages

# The std of every random weight (norm scales start at 1, biases at 0); the host-side random
# checkpoints of `models.random_checkpoint` draw at the same scales.
INIT_STD = 0.02


class KVCache(NamedTuple):
    """Per-layer key/value caches, each `[B, S, K, X]` (tuples so updates stay per layer)."""
    k: tuple
    v: tuple

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = dtype or cfg.dtype
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def _param(rngs: Optional[nnx.Rngs], shape, axes, dtype, init="normal"):
    if init == "normal":
        value = INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies `[X/2]`, with llama3 scaling (Llama 3.1 report) when configured."""
    x = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, x, 2, dtype=jnp.float32) / x))
    if cfg.rope_scaling:
        s = dict(cfg.rope_scaling)
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = jnp.where(wavelen > low_wavelen, inv / factor,
                        jnp.where(wavelen < high_wavelen, inv, mid))
    return inv


def apply_rope(x_bthx: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    angles = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [b, t, x/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    xf = x_bthx.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x_bthx.dtype)


def lora_delta(module: nnx.Module, name: str, x, dt):
    """`scale · (x·A)·B` of projection `name`'s LoRA adapter on `module` (`models.lora`), or
    None when it has none. A contracts x's trailing input axes, B yields W's output axes."""
    a = getattr(module, name + "_lora_a", None)
    if a is None:
        return None
    a, b = a[...].astype(dt), getattr(module, name + "_lora_b")[...].astype(dt)
    xa = jnp.tensordot(x.astype(dt), a, axes=a.ndim - 1)
    return (jnp.tensordot(xa, b, axes=1) * module.lora_scale).astype(dt)


def _adapted(module: nnx.Module, name: str, x, y):
    """`y` (= x·W) plus the adapter's term when `name` has one."""
    delta = lora_delta(module, name, x, y.dtype)
    return y if delta is None else y + delta


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, rngs=None):
        self.weight = _param(rngs, (dim,), ("norm",), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(jnp.float32) * xf.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, x, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, \
            cfg.param_dtype
        self.cfg = cfg
        self.q_proj = _param(rngs, (d, h, x), ("embed", "q_heads", "head_dim"), pd)
        self.k_proj = _param(rngs, (d, k, x), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, (d, k, x), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, (h, x, d), ("q_heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (h, x), ("q_heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(rngs, (k, x), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(rngs, (k, x), ("kv_heads", "head_dim"), pd, init="zeros")
        if cfg.o_bias:
            self.o_bias = _param(rngs, (d,), ("norm",), pd, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(x, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(x, cfg.rms_norm_eps, pd)

    def project(self, x_btd, positions_bt, inv_freq):
        """Queries `[B, T, H, X]` and keys/values `[B, T, K, X]`, biases, q/k norms and RoPE
        applied (shared with the engine's specialised decode step)."""
        cfg, dt = self.cfg, self.cfg.dtype
        x_btd = x_btd.astype(dt)
        q = _adapted(self, "q_proj", x_btd,
                     jnp.einsum("btd,dhx->bthx", x_btd, self.q_proj[...].astype(dt)))
        k = _adapted(self, "k_proj", x_btd,
                     jnp.einsum("btd,dkx->btkx", x_btd, self.k_proj[...].astype(dt)))
        v = _adapted(self, "v_proj", x_btd,
                     jnp.einsum("btd,dkx->btkx", x_btd, self.v_proj[...].astype(dt)))
        if cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if cfg.qk_norm:
            q, k = self.q_norm(q).astype(dt), self.k_norm(k).astype(dt)
        return apply_rope(q, positions_bt, inv_freq), apply_rope(k, positions_bt, inv_freq), v

    def output(self, out_bthx):
        """The output projection of attention values `[..., H, X]` -> `[..., D]`."""
        dt = self.cfg.dtype
        y = _adapted(self, "o_proj", out_bthx,
                     jnp.einsum("...hx,hxd->...d", out_bthx, self.o_proj[...].astype(dt)))
        if self.cfg.o_bias:
            y = y + self.o_bias[...].astype(dt)
        return y

    def __call__(self, x_btd, positions_bt, inv_freq, cache_kv=None, segment_ids=None):
        cfg, dt = self.cfg, self.cfg.dtype
        q, k, v = self.project(x_btd, positions_bt, inv_freq)

        b, t = positions_bt.shape
        if isinstance(cache_kv, PagedKVCache):  # one layer's pool and the batch's tables
            table = cache_kv.page_table
            pool = write_pages(cache_kv.kv[0], table, positions_bt, k, v)
            out = paged_attention(q, pool, table, positions_bt)
            return self.output(out), pool
        if cache_kv is None:
            keys, values, key_pos = k, v, positions_bt
            new_cache = None
        else:
            ck, cv = cache_kv
            rows = jnp.arange(b)[:, None]
            ck = ck.at[rows, positions_bt].set(k.astype(ck.dtype), mode="drop")
            cv = cv.at[rows, positions_bt].set(v.astype(cv.dtype), mode="drop")
            keys, values = ck.astype(dt), cv.astype(dt)
            key_pos = jnp.broadcast_to(jnp.arange(ck.shape[1]), (b, ck.shape[1]))
            new_cache = (ck, cv)

        g = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, t, cfg.num_kv_heads, g, cfg.head_dim)
        scores = jnp.einsum("btkgx,bskx->bkgts", q, keys).astype(jnp.float32)
        scores = scores / math.sqrt(cfg.head_dim)
        if segment_ids is None:
            causal = key_pos[:, None, :] <= positions_bt[:, :, None]  # [b, t, s]
        else:  # packed rows: causal by index, and only within the same sequence
            idx = jnp.arange(t)
            causal = (idx[None, None, :] <= idx[None, :, None]) & (
                segment_ids[:, :, None] == segment_ids[:, None, :])
        scores = jnp.where(causal[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bkgts,bskx->btkgx", probs, values)
        return self.output(out.reshape(b, t, cfg.num_heads, cfg.head_dim)), new_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.cfg = cfg
        self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), pd)
        if cfg.mlp_bias:
            self.gate_bias = _param(rngs, (f,), ("mlp",), pd, init="zeros")
            self.up_bias = _param(rngs, (f,), ("mlp",), pd, init="zeros")
            self.down_bias = _param(rngs, (d,), ("norm",), pd, init="zeros")

    def __call__(self, x_btd):
        dt = self.cfg.dtype
        x_btd = x_btd.astype(dt)
        gate = _adapted(self, "gate_proj", x_btd, x_btd @ self.gate_proj[...].astype(dt))
        up = _adapted(self, "up_proj", x_btd, x_btd @ self.up_proj[...].astype(dt))
        if self.cfg.mlp_bias:
            gate, up = gate + self.gate_bias[...].astype(dt), up + self.up_bias[...].astype(dt)
        act = jax.nn.silu(gate) * up
        y = _adapted(self, "down_proj", act, act @ self.down_proj[...].astype(dt))
        if self.cfg.mlp_bias:
            y = y + self.down_bias[...].astype(dt)
        return y


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, h_btd, positions_bt, inv_freq, cache_kv=None, segment_ids=None):
        a, new_cache = self.attn(self.input_norm(h_btd), positions_bt, inv_freq, cache_kv,
                                 segment_ids)
        h_btd = h_btd + a.astype(h_btd.dtype)
        h_btd = h_btd + self.mlp(self.post_attn_norm(h_btd)).astype(h_btd.dtype)
        return h_btd, new_cache


class Decoder(nnx.Module):
    """`Decoder(cfg, rngs)(input_ids [B, T]) -> logits [B, T, V]` (float32 logits)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                            cfg.param_dtype)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.param_dtype)

    def hidden_states(self, input_ids, positions=None, cache=None, segment_ids=None):
        """Final-norm hidden states `[B, T, D]` (and the updated cache when one is given: a
        dense `KVCache`, or a `PagedKVCache` with its page tables, `models.paged_attention`).

        `segment_ids` `[B, T]` (no cache): several sequences packed in one row attend only
        within their own segment; pass `positions` restarting at 0 for each.
        """
        cfg = self.cfg
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed rows) cannot be combined with a KV cache")
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        inv_freq = rope_frequencies(cfg)
        h = jnp.take(self.embed[...], input_ids, axis=0).astype(cfg.dtype)
        new = []  # per layer: the pool (paged) or (keys, values)
        for i, layer in enumerate(self.layers):
            if cache is None:
                layer_cache = None
            elif isinstance(cache, PagedKVCache):
                layer_cache = PagedKVCache((cache.kv[i],), cache.page_table)
            else:
                layer_cache = (cache.k[i], cache.v[i])
            h, c = layer(h, positions, inv_freq, layer_cache, segment_ids)
            new.append(c)
        h = self.final_norm(h)
        if cache is None:
            return h, None
        if isinstance(cache, PagedKVCache):
            return h, PagedKVCache(tuple(new), cache.page_table)
        return h, KVCache(tuple(c[0] for c in new), tuple(c[1] for c in new))

    def logits_from_hidden(self, h_btd):
        dt = self.cfg.dtype
        if self.cfg.tie_word_embeddings:
            w_dv = self.embed[...].astype(dt).T
        else:
            w_dv = self.lm_head[...].astype(dt)
        return (h_btd.astype(dt) @ w_dv).astype(jnp.float32)

    def __call__(self, input_ids, positions=None, cache=None, segment_ids=None):
        h, new_cache = self.hidden_states(input_ids, positions, cache, segment_ids)
        logits = self.logits_from_hidden(h)
        return logits if cache is None else (logits, new_cache)


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array,
                   temperature: float | jax.Array = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[tokens], float32 `[B, T]`."""
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens_bt[..., None], axis=-1)[..., 0]


def token_entropy(logits_btv: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
