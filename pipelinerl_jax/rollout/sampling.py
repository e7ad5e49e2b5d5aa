"""Token sampling for the embedded engine: temperature, top-k, top-p, per-token PRNG keys.

All functions are pure and jittable over a batch of rows that each carry their own
parameters, so one compiled step serves requests with different settings.

The distribution a token is drawn from (row with temperature T, top-k k, top-p p):

    z      = logits / T                                   (T = 0 means greedy, see below)
    keep_k = the k largest z (k = 0: every token)          (ties at the k-th value are kept)
    keep_p = the smallest prefix of keep_k, sorted by z descending, whose probability under
             softmax(z restricted to keep_k) reaches p: token i is kept when the mass of the
             tokens ranked before it is < p                (ties at the cut value are kept)
    q      = softmax(z restricted to keep_k ∩ keep_p)     (renormalised over the support)

`logprob_mode` says which log-probability is returned for the sampled token x:
    'sampled'  : log q(x), the distribution actually sampled from (the default);
    'tempered' : log softmax(z)(x), temperature only, no truncation.
Both are identical when k = 0 and p = 1. A learner recomputes 'tempered' exactly as
`token_logprobs(logits, tokens, temperature=T)`; 'sampled' additionally needs the same
truncation (log q = log softmax(z)(x) - logsumexp of log softmax(z) over the support).
Greedy rows (T = 0) take argmax(logits) and report log softmax(logits)(x) (T = 1, untruncated)
in both modes: the point mass they sample from has log-probability 0, which tells a learner
nothing.

Randomness: the uniform draw for the token at sequence position `pos` of sample `i` of a
request with seed `s` uses the key fold_in(fold_in(key(s), i), pos). It depends on nothing
else, so a sample's tokens do not depend on which other requests share the batch, on the slot
it occupies, on how many decode steps run per host sync, or on a re-prefill after a weight
update. Tokens are drawn by inverse-CDF sampling (one uniform per token, not a Gumbel vector
over the vocabulary, which costs a PRNG call per vocabulary entry on CPU), with a two-level
cumulative sum (`inverse_cdf`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LOGPROB_MODES = ("sampled", "tempered")


class RowParams(NamedTuple):
    """Per-row sampling parameters, each `[B]` (stop ids `[B, M]`, padded with -1)."""
    seed: jax.Array  # uint32
    sample_index: jax.Array  # int32
    temperature: jax.Array  # float32, 0 = greedy
    top_p: jax.Array  # float32 in (0, 1]
    top_k: jax.Array  # int32, 0 = off
    stop_ids: jax.Array  # int32 [B, M]
    limit: jax.Array  # int32: the sample ends when its total length (prompt + new) reaches this


def token_keys(seed_b, sample_index_b, position_b):
    """The PRNG key of each row's token at `position_b` (see module docstring)."""
    def one(s, i, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), p)
    return jax.vmap(one)(seed_b, sample_index_b, position_b)


def truncate(z_bv, top_k_b, top_p_b):
    """`z` with tokens outside the top-k ∩ top-p support set to -inf (module docstring)."""
    v = z_bv.shape[-1]
    sorted_bv = -jnp.sort(-z_bv, axis=-1)  # descending
    ranks = jnp.arange(v)[None, :]
    k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, v), v)
    in_k = ranks < k_b[:, None]
    p_sorted = jax.nn.softmax(jnp.where(in_k, sorted_bv, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    keep = in_k & (mass_before < top_p_b[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_bv, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(z_bv >= threshold, z_bv, -jnp.inf)


def _first_max(z_bv, m_b):
    """Index of the first maximum of each row (argmax, but one cheap pass on CPU)."""
    v = z_bv.shape[-1]
    return jnp.min(jnp.where(z_bv == m_b[:, None], jnp.arange(v), v), axis=-1).astype(jnp.int32)


def _last_positive(w_bn):
    n = w_bn.shape[-1]
    return n - 1 - jnp.argmax((w_bn > 0)[:, ::-1], axis=-1)


def inverse_cdf(w_bv, u_b, block: int = 256):
    """The first index whose cumulative weight exceeds `u * sum(w)` (w >= 0, some w > 0).

    Two levels (sums of blocks of `block` entries, then a cumulative sum inside the chosen
    block) because a cumulative sum over a 32k vocabulary is slow on CPU. The result always
    has w > 0, also when float rounding puts the target at the very end.
    """
    b, v = w_bv.shape
    c = min(block, v)
    nb = -(-v // c)
    w_bnc = jnp.pad(w_bv, ((0, 0), (0, nb * c - v))).reshape(b, nb, c)
    mass_bn = jnp.sum(w_bnc, axis=-1)
    cdf_bn = jnp.cumsum(mass_bn, axis=-1)
    target_b = u_b * cdf_bn[:, -1]
    j_b = jnp.minimum(jnp.sum(cdf_bn <= target_b[:, None], axis=-1), _last_positive(mass_bn))
    before_b = jnp.take_along_axis(cdf_bn - mass_bn, j_b[:, None], axis=-1)[:, 0]
    w_bc = jnp.take_along_axis(w_bnc, j_b[:, None, None], axis=1)[:, 0]
    residual_b = jnp.maximum(target_b - before_b, 0.0)
    i_b = jnp.sum(jnp.cumsum(w_bc, axis=-1) <= residual_b[:, None], axis=-1)
    i_b = jnp.minimum(i_b, _last_positive(w_bc))
    return (j_b * c + i_b).astype(jnp.int32)


def sample(logits_bv, rows: RowParams, position_b, logprob_mode: str = "sampled"):
    """Samples one token per row; returns (tokens `[B]` int32, logp `[B]` float32).

    `position_b` is the sequence position the sampled token will occupy (its PRNG key).
    """
    if logprob_mode not in LOGPROB_MODES:
        raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {logprob_mode!r}")
    logits_bv = logits_bv.astype(jnp.float32)
    greedy_b = rows.temperature <= 0
    z_bv = logits_bv / jnp.where(greedy_b, 1.0, rows.temperature)[:, None]
    truncating_b = ~greedy_b & ((rows.top_k > 0) | (rows.top_p < 1.0))
    # The sort behind top-k/top-p is the costliest part of sampling: skip it when no row asks.
    any_truncating = jnp.any(truncating_b)
    zs_bv = jax.lax.cond(
        any_truncating,
        lambda z: jnp.where(truncating_b[:, None], truncate(z, rows.top_k, rows.top_p), z),
        lambda z: z, z_bv)
    m_b = jnp.max(zs_bv, axis=-1)
    w_bv = jnp.exp(zs_bv - m_b[:, None])  # 0 outside the support
    lse_b = m_b + jnp.log(jnp.sum(w_bv, axis=-1))

    keys = token_keys(rows.seed, rows.sample_index, position_b)
    u_b = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    drawn_b = inverse_cdf(w_bv, u_b)
    tokens_b = jax.lax.cond(jnp.any(greedy_b),
                            lambda: jnp.where(greedy_b, _first_max(zs_bv, m_b), drawn_b),
                            lambda: drawn_b)

    if logprob_mode == "tempered":  # untruncated normaliser; equal to lse_b without truncation
        lse_b = jax.lax.cond(any_truncating, lambda: jax.nn.logsumexp(z_bv, axis=-1),
                             lambda: lse_b)
    logp_b = jnp.take_along_axis(z_bv, tokens_b[:, None], axis=-1)[:, 0] - lse_b
    return tokens_b, logp_b


def is_stop(tokens_b, stop_ids_bm):
    """Whether each row's token is one of its stop ids (-1 pads never match)."""
    return jnp.any(tokens_b[:, None] == stop_ids_bm, axis=-1)
