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

Off-policy optimal baseline (OPOB, `loss.baseline`). The minimum-variance baseline of the
importance-weighted policy gradient Σ_i W_i (R_i - b) ∇log π(τ_i), in the authors' README
(the paper's closed form; its method section was not readable here):

    b* = Σ_i W_i² ‖∇log π(τ_i)‖² R_i / Σ_i W_i² ‖∇log π(τ_i)‖²

The authors' runs (every VCPO script: `grad_baselining.enable=True`, scope 'group',
agg_mode 'mean', use_is_weights, not clipped, not length-normalised, norm_by_std) compute it
in `compute_opob_baseline` (staleness_utils.py) per group (one prompt's samples, kept in one
minibatch), from per-trajectory backward passes (`update_policy_per_traj` in
megatron_actor.py): g_i is the gradient of the trajectory's own loss term at advantage 1 —
the truncated weight min(W_i, cap) times ∇log π(τ_i) (their `_compute_grad_norms` undoes the
token mean and the 1/B) — and the weight of R_i is ‖g_i‖² times the *unclipped* W_i² once more.
The update is then Σ_i (R_i - b_g)/σ_g · g_i, σ_g the group's (population) reward std.
Here, per group g of the minibatch (`batching.pack`'s `group`), over its rows with trained
tokens:

    s_i = ‖∇_θ Σ_t m_t log π_θ(t)‖²               (one backward per sequence, trained params)
    λ_i = s_i · min(W_i, cap)² · W_i²              baseline='opob'    (the authors' runs)
    λ_i = s_i · W_i²                               baseline='opob_eq' (the README equation)
    b_g = Σ_{i∈g} λ_i A_i / Σ_{i∈g} λ_i,   A_i ← A_i - b_g     (0 if every λ_i of g is 0)
    baseline='none'                                the ESS-scaled step alone

With the group estimator's advantages A_i = (R_i - mean_g R)/(std_g R + ε) (GRPO, population
std) this is the authors' (R_i - b*_g)/σ_g up to the factor σ_g/(σ_g + ε) on the whole group:
the weighted mean of A over g is (b*_g - mean_g R)/(σ_g + ε). (With dr_grpo, R_i - b*_g: their
norm_by_std=False.) W_i is the loss's own sequence weight (π_prox/μ, log clamped to ±20) and
s_i is taken at the minibatch's current parameters; the weights are normalised in log space by
the group's largest (the authors add 1e-8 to the sum instead), so W_i⁴ cannot overflow.
The learner's train step computes this (`baselined_advantages`, before the minibatch's
gradient): it needs parameter gradients, so `loss_fn` called alone uses the advantages it is
given. The scope is the whole minibatch's part of each group, across its micro-batches. Cost:
per sequence, one forward and one backward of the packed row that holds it (`jax.vjp`; only
the squared norm is kept): about rows-per-micro-batch times less than a backward of the whole
micro-batch per sequence (scripts/bench_vcpo_baseline.py).
"""
from __future__ import annotations

import jax.numpy as jnp

from pipelinerl_jax.losses.core import Prepared, ratio, sg
from pipelinerl_jax.losses.diagnostics import sequence_ess
from pipelinerl_jax.losses.policy import Terms, proximal_logp
from pipelinerl_jax.losses.seq_is import log_weight

SCALINGS = ("sqrt", "linear")
BASELINES = ("opob", "opob_eq", "none")


def vcpo(x: Prepared, cap: float, ess_base: float, scaling: str, baseline: str = "none") -> Terms:
    del baseline  # applied to the advantages by the train step (`baselined_advantages`)
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


def sequence_log_weight(logp_prox, logp_mu, loss_mask):
    """[N] log W_i of VCPO's sequence weight (clamped to ±20), from raw `[N, C]` inputs cleaned
    as `core.prepare` cleans them."""
    trained = loss_mask > 0
    m = jnp.where(trained, jnp.asarray(loss_mask, jnp.float32), 0.0)
    d = jnp.where(trained, jnp.asarray(logp_prox, jnp.float32) - jnp.where(
        trained, jnp.asarray(logp_mu, jnp.float32), 0.0), 0.0)
    return log_weight(d, m, "sequence")[:, 0]


def opob_baselines(sq_norm, log_w, adv, group, valid, cap, form: str):
    """[N] baseline b of each row's group (see the module docstring). `sq_norm` [N]: s_i;
    `log_w` [N]: log W_i; `adv` [N]: the row's advantage; `group` [N] int; `valid` [N] bool
    (rows with trained tokens); `cap`: the truncation cap (may be traced)."""
    log_lam = jnp.log(sq_norm) + 2.0 * log_w
    if form == "opob":
        log_lam = log_lam + 2.0 * jnp.minimum(log_w, jnp.log(jnp.float32(cap)))
    elif form != "opob_eq":
        raise ValueError(f"unknown baseline {form!r}; valid: {list(BASELINES)}")
    log_lam = jnp.where(valid, log_lam, -jnp.inf)
    same = (group[:, None] == group[None, :]) & valid[None, :]
    lam = jnp.where(same, log_lam[None, :], -jnp.inf)  # [N, N]: row i's group's weights
    top = jnp.max(lam, axis=1, keepdims=True)
    e = jnp.exp(lam - jnp.where(jnp.isfinite(top), top, 0.0))
    den = jnp.sum(e, axis=1)
    num = jnp.sum(e * adv[None, :], axis=1)
    return jnp.where(valid & (den > 0), num / jnp.where(den > 0, den, 1.0), 0.0)
