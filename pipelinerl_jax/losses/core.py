"""Shared pieces of every policy loss: the inputs, input cleaning, aggregation, KL to a reference.

Notation (DESIGN.md, "Loss specification"), per completion token of a `[B, T]` batch:
  logp      log π_θ, the current policy — the only differentiated input;
  logp_mu   log μ, the behaviour policy the token was sampled from;
  logp_old  the proximal policy `logp_proximal` when given, else logp_mu;
  A         the advantage; m the loss mask (1 on trained tokens); lag the policy lag.
Every input but `logp` is held under stop-gradient.

Masked tokens (m == 0) are *cleaned*: all their inputs are replaced by zeros before anything
is computed, so padding holding garbage (-inf log-probs, NaN advantages) can neither change the
loss nor leak a NaN into a gradient (`where` alone would: 0 · inf = NaN in the backward pass).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

# Ratios are exp(log-ratio); above e^88 float32 overflows to inf. Every ratio a loss multiplies
# by is therefore computed from a log-ratio clamped to ±MAX_LOG_RATIO *in value* while its
# gradient passes straight through (verl clamps at the same bound). Inside the band every loss is
# exactly the formula of the spec; a token with a ratio beyond e^20 ≈ 4.9e8 is pathological.
MAX_LOG_RATIO = 20.0

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")

sg = jax.lax.stop_gradient


class LossInputs(NamedTuple):
    """What the learner hands a loss; every field `[B, T]`, one sequence per row.

    `logp_proximal` may be None (then the behaviour policy stands in for it). `logp_ref`
    (reference policy, for the KL penalty), `entropy` (per-token entropy of the current
    policy, reported as a diagnostic) and `engine` (int: index of the engine that sampled the
    token, for the per-engine mismatch diagnostic) are optional.
    """
    logp: Array
    logp_behaviour: Array
    logp_proximal: Optional[Array]
    advantages: Array
    loss_mask: Array
    lag: Array
    logp_ref: Optional[Array] = None
    entropy: Optional[Array] = None
    engine: Optional[Array] = None


class Prepared(NamedTuple):
    """Cleaned float32 inputs; zeros on untrained tokens (see module docstring)."""
    logp: Array  # differentiated
    logp_mu: Array
    logp_old: Array
    adv: Array
    m: Array  # float mask, 0 off the trained tokens
    trained: Array  # bool, m > 0
    lag: Array  # int32, 0 off the trained tokens
    has_proximal: bool


def prepare(inputs: LossInputs) -> Prepared:
    m = jnp.asarray(inputs.loss_mask, jnp.float32)
    trained = m > 0
    m = jnp.where(trained, m, 0.0)

    def clean(a):
        return jnp.where(trained, jnp.asarray(a, jnp.float32), 0.0)

    logp_mu = sg(clean(inputs.logp_behaviour))
    has_proximal = inputs.logp_proximal is not None
    logp_old = sg(clean(inputs.logp_proximal)) if has_proximal else logp_mu
    lag = jnp.where(trained, jnp.asarray(inputs.lag, jnp.int32), 0)
    return Prepared(logp=clean(inputs.logp), logp_mu=logp_mu, logp_old=logp_old,
                    adv=sg(clean(inputs.advantages)), m=m, trained=trained, lag=lag,
                    has_proximal=has_proximal)


def ratio(log_ratio: Array) -> Array:
    """exp(log_ratio) with the value clamped to ±MAX_LOG_RATIO and a straight-through gradient."""
    clamped = jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.exp(log_ratio + sg(clamped - log_ratio))


def clipped_surrogate(r: Array, adv: Array, lo, hi) -> Array:
    """PPO's pessimistic surrogate, negated: -min(r·A, clip(r, lo, hi)·A) (Schulman 2017)."""
    return -jnp.minimum(r * adv, jnp.clip(r, lo, hi) * adv)


def _safe(denominator: Array) -> Array:
    # An empty normaliser means an empty numerator: report 0, never 0/0.
    return jnp.where(denominator > 0, denominator, 1.0)


def aggregate(ell: Array, weight: Array, agg: str, max_tokens: Optional[int] = None) -> Array:
    """Reduces the per-token term ℓ over the tokens of `weight` (the loss's normaliser mask).

    token_mean           Σ ℓ·m / Σ m over the batch;
    seq_mean_token_mean  mean over rows with any token of Σ_t ℓ·m / Σ_t m;
    seq_mean_token_sum   mean over those rows of Σ_t ℓ·m;
    constant             Σ ℓ·m / (B · max_tokens)  (Dr. GRPO, Liu et al. 2025).
    """
    total = jnp.sum(ell * weight)
    if agg == "token_mean":
        return total / _safe(jnp.sum(weight))
    if agg == "constant":
        return total / (ell.shape[0] * max_tokens)
    row_weight = jnp.sum(weight, axis=1)
    row_sum = jnp.sum(ell * weight, axis=1)
    has = row_weight > 0
    if agg == "seq_mean_token_mean":
        row_sum = row_sum / _safe(row_weight)
    elif agg != "seq_mean_token_sum":
        raise ValueError(f"unknown aggregation {agg!r}; valid: {AGGREGATIONS}")
    return jnp.sum(jnp.where(has, row_sum, 0.0)) / _safe(jnp.sum(has.astype(jnp.float32)))


def kl_to_reference(logp: Array, logp_ref: Array, estimator: str) -> Array:
    """Per-token estimate of KL(π_θ || π_ref) from tokens of π_θ (Schulman, "Approximating KL
    divergence", 2020): with δ = logp_ref - logp, k1 = -δ, k2 = δ²/2, k3 = e^δ - 1 - δ."""
    delta = sg(logp_ref) - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return ratio(delta) - 1.0 - delta
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {KL_ESTIMATORS}")
