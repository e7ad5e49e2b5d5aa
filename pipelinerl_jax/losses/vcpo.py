"""VCPO, variance-controlled policy optimisation (Huang, Zhang, Hu, Yang, Han 2026, "Stable
Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616; the authors' code,
github.com/mit-han-lab/vcpo: `compute_ess_info` in recipe/fully_async_policy/staleness_utils.py,
`_optimizer_step_with_buffer` in verl/workers/actor/megatron_actor.py).

Stale rollouts make sequence importance ratios heavy-tailed, a few sequences dominate the
update and the gradient's variance explodes; the effective sample size of the sequence weights
predicts the collapse. VCPO keeps the truncated sequence-IS policy gradient and shrinks the
*step* when the ESS falls. Over the B rows of the minibatch with trained tokens:

    W_b = exp(Σ_t log π_prox(t) - log μ(t))        (unclipped, sg; π_prox as in `seq_is`)
    ρ_ess = (Σ_b W_b)² / (B·Σ_b W_b²)               (ESS / B, in (0, 1])
    step scale s = min(1, ρ_ess/ess_base)^(1/2)     (scaling 'sqrt', the AdamW rule; 'linear': ^1)
    ℓ = -sg(min(W_b, cap))·r·A,   r = π_θ/π_prox    (the authors' runs: sequence TIS at cap 8 on
                                                     PPO with its clip disabled)

The learner multiplies the optimizer's update by s (for AdamW exactly the learning rate times
s). With micro-batches, s is their token-weighted mean of per-micro-batch ESS scales (exact at
micro_batches=1, the default).

Not implemented: the paper's closed-form off-policy optimal baseline (OPOB),
b* = Σ_i W_i²‖∇log π(τ_i)‖² R_i / Σ_i W_i²‖∇log π(τ_i)‖², needs each sequence's own gradient
norm (the authors run one backward pass per trajectory); the train step computes no
per-sequence gradients, and dropping the norms would be an estimator of our own, not VCPO's.
"""
from __future__ import annotations

import jax.numpy as jnp

from pipelinerl_jax.losses.core import Prepared, ratio, sg
from pipelinerl_jax.losses.diagnostics import sequence_ess
from pipelinerl_jax.losses.policy import Terms, proximal_logp
from pipelinerl_jax.losses.seq_is import log_weight

SCALINGS = ("sqrt", "linear")


def vcpo(x: Prepared, cap: float, ess_base: float, scaling: str) -> Terms:
    logp_prox = proximal_logp(x)
    d = logp_prox - x.logp_mu
    log_w = log_weight(d, x.m, "sequence")
    log_cap = jnp.log(jnp.float32(cap))
    weight = jnp.exp(jnp.minimum(log_w, log_cap))
    ell = -sg(weight) * ratio(x.logp - logp_prox) * x.adv
    ess_ratio = sequence_ess(d, x.m)
    fraction = jnp.minimum(1.0, ess_ratio / jnp.float32(ess_base))
    scale = jnp.sqrt(fraction) if scaling == "sqrt" else fraction
    return Terms(ell=ell, clip_high=log_w > log_cap,
                 metrics={"step_scale": scale, "vcpo_ess_ratio": ess_ratio})
