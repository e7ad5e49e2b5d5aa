"""A-3PO: decoupled PPO with the proximal policy approximated, not recomputed (AReaL,
`prox_logp_method='loglinear'`, docs/algorithms/prox_approx.md; `compute_prox_logp_approximations`
in `areal/trainer/ppo/actor.py`).

Decoupled PPO (AReaL, Fu et al. 2025) needs log π_prox, the policy at the start of the update,
which costs the learner one extra forward pass over the batch when it takes several minibatch
steps. A-3PO interpolates it in log space between the behaviour policy and the current one,
by the token's version (AReaL: v_θ = the trainer's current version, v_prox = v_θ - 1,
v_μ = the version that sampled the token; here lag = v_θ - v_μ):

    α = (v_prox - v_μ)/(v_θ - v_μ) = (lag - 1)/lag   clamped to [0, 1]; 0 at lag 0
    log π_prox ≈ log μ + α·(sg(log π_θ) - log μ)
    ℓ = -sg(w')·min(r·A, clip(r, 1-eps_low, 1+eps_high)·A),
        w = π_prox/μ = exp(α·(sg(log π_θ) - log μ)),  w' = w or min(w, behave_cap),
        r = π_θ/π_prox

The learner never computes a proximal policy for it (no recompute pass at any number of
minibatches). At lag 0 and 1, α = 0: π_prox = μ, w = 1 and this is `ppo` exactly; from lag 2
it differs from `decoupled_ppo` with a recomputed π_prox.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from pipelinerl_jax.losses.core import MAX_LOG_RATIO, Prepared, sg
from pipelinerl_jax.losses.policy import Terms, clip_range, decoupled


def interpolation_weight(lag):
    """α = (lag - 1)/lag clamped to [0, 1], 0 at lag 0 (AReaL's version-aware weight)."""
    lag = lag.astype(jnp.float32)
    return jnp.clip(jnp.where(lag > 0, (lag - 1.0) / jnp.where(lag > 0, lag, 1.0), 0.0),
                    0.0, 1.0)


def a3po(x: Prepared, eps_low: float, eps_high: float, behave_cap: Optional[float]) -> Terms:
    alpha = interpolation_weight(x.lag)
    log_w = alpha * (sg(x.logp) - x.logp_mu)
    logp_prox = x.logp_mu + log_w
    weight = jnp.exp(jnp.clip(log_w, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    if behave_cap is not None:
        weight = jnp.minimum(weight, behave_cap)
    terms = decoupled(x, *clip_range(eps_low, eps_high), weight, logp_old=logp_prox)
    n = jnp.maximum(jnp.sum(x.trained), 1)
    return terms._replace(metrics={
        "a3po_alpha_mean": jnp.sum(jnp.where(x.trained, alpha, 0.0)) / n,
        "a3po_w_mean": jnp.sum(jnp.where(x.trained, weight, 0.0)) / n})
