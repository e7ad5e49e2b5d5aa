"""Rollout correction with sequence-level importance weights: truncated (TIS) or masked (MIS),
per sequence or as the geometric mean of its token ratios, with an optional per-token veto.

Sources: verl's rollout correction (Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch"; verl
`trainer/ppo/rollout_corr_helper.py`: `rollout_is` token|sequence truncated at
`rollout_is_threshold`, `rollout_rs` token|sequence|geometric keeping weights in
[lower, upper] with lower = 1/upper by default, `rollout_token_veto_threshold`), and the masked
importance sampling of slime and AReaL. The weight compares the trainer's policy with the
sampler's, so it corrects the train-inference mismatch and (through π_prox) staleness.

Per row b, with d_t = log π_prox(t) - log μ(t) over its trained tokens (π_prox: the proximal
policy; without one, the current policy held fixed — what the learner's proximal policy is at
minibatches=1) and every log-weight clamped to ±20 in value (verl's safety bound):

    level='sequence'   log W_b = Σ_t d_t                (the sequence's likelihood ratio)
    level='geometric'  log W_b = Σ_t d_t / |b|          (its per-token geometric mean)
    level='token'      log W_t = d_t                    (verl's token level; for comparison)
    mode='truncate'    w = min(W, high)                 (TIS)
    mode='mask'        w = W if low ≤ W ≤ high, else the row (token, at level='token') is
                       excluded                         (MIS; low = 1/high unless set)
    veto               a row holding any token with π_prox/μ < veto is excluded whole
    ℓ = -sg(w)·min(r·A, clip(r, 1-eps_low, 1+eps_high)·A),   r = π_θ/π_prox.

Excluded tokens get ℓ = 0 and leave the normaliser: verl removes them from the response mask
the loss is averaged over. level='token', mode='truncate' is `decoupled_ppo` with
behave_cap=high; with μ = π_prox (on-policy data) every weight is 1 and this is PPO.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from pipelinerl_jax.losses.core import MAX_LOG_RATIO, Prepared
from pipelinerl_jax.losses.policy import Terms, clip_range, decoupled, proximal_logp

LEVELS = ("sequence", "geometric", "token")
MODES = ("truncate", "mask")


def log_weight(d, m, level: str):
    """[B, T] log W (clamped to ±MAX_LOG_RATIO) of `level`, broadcast over each row."""
    if level == "token":
        log_w = d
    else:
        log_w = jnp.sum(m * d, axis=1, keepdims=True)
        if level == "geometric":
            count = jnp.sum(m, axis=1, keepdims=True)
            log_w = log_w / jnp.where(count > 0, count, 1.0)
        log_w = jnp.broadcast_to(log_w, d.shape)
    return jnp.clip(log_w, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def seq_is(x: Prepared, eps_low: float, eps_high: float, level: str, mode: str, high: float,
           low: Optional[float], veto: Optional[float]) -> Terms:
    logp_prox = proximal_logp(x)
    d = logp_prox - x.logp_mu
    log_w = log_weight(d, x.m, level)
    log_high = jnp.log(jnp.float32(high))
    if mode == "truncate":
        weight = jnp.exp(jnp.minimum(log_w, log_high))
        excluded = jnp.zeros_like(x.trained)
        capped = log_w > log_high
    else:
        log_low = -log_high if low is None else jnp.log(jnp.float32(low))
        excluded = (log_w < log_low) | (log_w > log_high)
        weight = jnp.where(excluded, 0.0, jnp.exp(log_w))
        capped = jnp.zeros_like(x.trained)
    vetoed = jnp.zeros((x.m.shape[0], 1), bool)
    if veto is not None:
        vetoed = jnp.any(x.trained & (d < jnp.log(jnp.float32(veto))), axis=1, keepdims=True)
        excluded = excluded | vetoed
        weight = jnp.where(vetoed, 0.0, weight)
    lo, hi = clip_range(eps_low, eps_high)
    terms = decoupled(x, lo, hi, weight, logp_old=logp_prox)
    rows = jnp.maximum(jnp.sum(jnp.any(x.trained, axis=1)), 1)
    n = jnp.maximum(jnp.sum(x.trained), 1)
    metrics = {"seq_is_weight_mean": jnp.sum(jnp.where(x.trained, weight, 0.0)) / n,
               "seq_is_excluded_frac": jnp.sum(excluded & x.trained) / n,
               "seq_is_veto_row_frac": jnp.sum(vetoed[:, 0] & jnp.any(x.trained, axis=1))
               / rows}
    return terms._replace(norm=jnp.where(excluded, 0.0, x.m), masked=excluded & x.trained,
                          clip_high=terms.clip_high | capped, metrics=metrics)
