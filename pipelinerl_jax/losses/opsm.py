"""Off-policy sequence masking (DeepSeek-AI 2025, "DeepSeek-V3.2: Pushing the Frontier of
Open Large Language Models", §3.1 "Off-Policy Sequence Masking").

A sequence with a negative advantage that has drifted far from the policy that sampled it is
dropped from the policy gradient: such samples push probability mass away from text the current
policy no longer produces, and are the ones whose updates the report found destabilising.
Per token t of row b:

    KL_b = (1/|b|) Σ_{t∈b} (log μ(t) - log π_θ(t))      (sg; μ: the sampler's log-probs)
    M_t  = 0 if A_t < 0 and KL_b > δ, else 1
    ℓ    = M_t · (-min(r·A, clip(r, 1-eps_low, 1+eps_high)·A)),   r = π_θ/μ

(the report's π_old is the sampler's policy as the inference framework returned it; a
proximal policy, if the learner computes one, is not read). The report states the mask per
sequence with one advantage per sequence; here the advantage test is per token, which is the
same for GRPO's per-sequence advantages and keeps multi-turn rows well defined. Masked tokens
get ℓ = 0 but stay in the normaliser (the mask multiplies inside the report's 1/|o_i| Σ_t).
With δ = +inf, with no negative advantage, or on on-policy data (KL_b = 0 ≤ δ) this is `ppo`
(without a proximal policy, which is how the learner runs both by default).
"""
from __future__ import annotations

import jax.numpy as jnp

from pipelinerl_jax.losses.core import Prepared, sg
from pipelinerl_jax.losses.policy import Terms, clip_range, decoupled


def sequence_kl(x: Prepared):
    """[B, 1] (1/|b|) Σ_t (log μ - log π_θ) over each row's trained tokens (0 on empty rows)."""
    count = jnp.sum(x.m, axis=1, keepdims=True)
    total = jnp.sum(x.m * (x.logp_mu - sg(x.logp)), axis=1, keepdims=True)
    return total / jnp.where(count > 0, count, 1.0)


def opsm(x: Prepared, eps_low: float, eps_high: float, delta: float) -> Terms:
    kl = sequence_kl(x)
    masked = x.trained & (x.adv < 0) & (kl > delta)
    terms = decoupled(x, *clip_range(eps_low, eps_high), jnp.where(masked, 0.0, 1.0),
                      logp_old=x.logp_mu)
    has = jnp.any(x.trained, axis=1)
    rows_masked = jnp.any(masked, axis=1)
    metrics = {"opsm_masked_row_frac": jnp.sum(rows_masked) / jnp.maximum(jnp.sum(has), 1),
               "opsm_seq_kl_mean": jnp.sum(jnp.where(has, kl[:, 0], 0.0))
               / jnp.maximum(jnp.sum(has), 1)}
    return terms._replace(masked=masked, metrics=metrics)
