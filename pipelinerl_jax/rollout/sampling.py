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
over the vocabulary, which costs a PRNG call per vocabulary entry on CPU).
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


def sample(logits_bv, rows: RowParams, position_b, logprob_mode: str = "sampled"):
    """Samples one token per row; returns (tokens `[B]` int32, logp `[B]` float32).

    `position_b` is the sequence position the sampled token will occupy (its PRNG key).
    """
    if logprob_mode not in LOGPROB_MODES:
        raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {logprob_mode!r}")
    logits_bv = logits_bv.astype(jnp.float32)
    greedy_b = rows.temperature <= 0
    temp_b = jnp.where(greedy_b, 1.0, rows.temperature)
    z_bv = logits_bv / temp_b[:, None]
    logp_tempered_bv = jax.nn.log_softmax(z_bv, axis=-1)

    truncating_b = ~greedy_b & ((rows.top_k > 0) | (rows.top_p < 1.0))
    # The sort behind top-k/top-p is the costliest part of sampling: skip it when no row asks.
    z_trunc_bv = jax.lax.cond(
        jnp.any(truncating_b),
        lambda z: jnp.where(truncating_b[:, None], truncate(z, rows.top_k, rows.top_p), z),
        lambda z: z, z_bv)
    logp_sampled_bv = jax.nn.log_softmax(z_trunc_bv, axis=-1)

    # Inverse CDF: the first token whose cumulative probability exceeds u * total.
    keys = token_keys(rows.seed, rows.sample_index, position_b)
    u_b = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    probs_bv = jnp.exp(logp_sampled_bv)
    cdf_bv = jnp.cumsum(probs_bv, axis=-1)
    drawn_b = jnp.sum(cdf_bv <= (u_b * cdf_bv[:, -1])[:, None], axis=-1)
    # Rounding can push the count past the last token with mass; clamp to it.
    v = logits_bv.shape[-1]
    last_b = v - 1 - jnp.argmax((probs_bv > 0)[:, ::-1], axis=-1)
    drawn_b = jnp.minimum(drawn_b, last_b)
    tokens_b = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), drawn_b).astype(jnp.int32)

    source_bv = logp_tempered_bv if logprob_mode == "tempered" else logp_sampled_bv
    logp_b = jnp.take_along_axis(source_bv, tokens_b[:, None], axis=-1)[:, 0]
    return tokens_b, logp_b


def is_stop(tokens_b, stop_ids_bm):
    """Whether each row's token is one of its stop ids (-1 pads never match)."""
    return jnp.any(tokens_b[:, None] == stop_ids_bm, axis=-1)
