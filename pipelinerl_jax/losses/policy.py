"""The policy losses: each turns cleaned inputs into a per-token term ℓ (then aggregated).

A loss returns `Terms`: ℓ `[B, T]`, the normaliser mask (the trained tokens unless the loss
*excludes* some), and for the diagnostics which tokens sit beyond its lower / upper clip and
which trained tokens it masked (ℓ = 0, still in the normaliser) or excluded. `gspo` is
sequence-level and returns its scalar directly. Notation: see `core`; r = π_θ/π_old,
w = π_old/μ, ρ = π_θ/μ. Quantities under sg are held fixed when differentiating.

Numeric hyperparameters may be traced scalars (one compiled loss serves every value), so a
loss never branches in Python on their values; only None (an unset option) and strings are
structural.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pipelinerl_jax.losses.core import MAX_LOG_RATIO, Prepared, clipped_surrogate, ratio, sg

Array = jax.Array


class Terms(NamedTuple):
    ell: Optional[Array] = None  # per-token term ℓ
    norm: Optional[Array] = None  # normaliser mask; None = the loss mask
    loss: Optional[Array] = None  # set instead of ℓ by sequence-level losses
    clip_low: Optional[Array] = None  # bool [B, T]: below the lower clip
    clip_high: Optional[Array] = None  # bool [B, T]: above the upper clip
    masked: Optional[Array] = None  # bool [B, T]: trained tokens the loss masked or excluded
    metrics: Optional[dict] = None  # loss-specific scalars


def reinforce(x: Prepared) -> Terms:
    """ℓ = -A·log π_θ: the plain policy gradient (Williams 1992), no off-policy correction."""
    return Terms(ell=-x.adv * x.logp)


def ppo(x: Prepared, eps_low: float, eps_high: float, dual_clip: Optional[float]) -> Terms:
    """PPO-clip (Schulman et al. 2017) with asymmetric range ("clip-higher", DAPO 2025):
    ℓ = -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A), r = π_θ/π_old. Dual clip (Ye et al. 2020,
    "Mastering complex control in MOBA games"): for A < 0, ℓ = min(ℓ, -c·A) bounds the loss of a
    token whose ratio has run far above 1."""
    r = ratio(x.logp - x.logp_old)
    lo, hi = clip_range(eps_low, eps_high)
    ell = clipped_surrogate(r, x.adv, lo, hi)
    metrics = {}
    if dual_clip is not None:
        bound = -dual_clip * x.adv
        dual = (x.adv < 0) & (bound < ell)
        ell = jnp.where(dual, bound, ell)
        metrics["dual_clip_frac"] = jnp.sum(dual & x.trained) / jnp.maximum(jnp.sum(x.trained), 1)
    return Terms(ell=ell, clip_low=r < lo, clip_high=r > hi, metrics=metrics)


def tis(x: Prepared, cap: float, level: str) -> Terms:
    """Truncated importance sampling against the behaviour policy (IMPALA/V-trace, Espeholt et
    al. 2018; PipelineRL, Piché et al. 2025): ℓ = -sg(min(ρ, cap))·A·log π_θ with ρ = π_θ/μ per
    token, or per row ρ = exp(Σ_t m·(log π_θ - log μ)) for level='sequence'."""
    log_rho = sg(x.logp - x.logp_mu)
    if level == "sequence":
        log_rho = jnp.broadcast_to(jnp.sum(x.m * log_rho, axis=1, keepdims=True), log_rho.shape)
    log_cap = jnp.log(jnp.asarray(cap, jnp.float32))
    # exp(min(log ρ, log cap)) == min(ρ, cap) and cannot overflow.
    weight = jnp.exp(jnp.minimum(log_rho, log_cap))
    return Terms(ell=-weight * x.adv * x.logp, clip_high=log_rho > log_cap)


def clip_range(eps_low, eps_high):
    """(1 - eps_low, 1 + eps_high) in float32, the same arithmetic for every loss."""
    one = jnp.float32(1.0)
    return (one - jnp.float32(eps_low), one + jnp.float32(eps_high))


def proximal_logp(x: Prepared) -> Array:
    """log π_prox: the proximal policy when given, else the current one held fixed (what the
    learner's proximal policy is at minibatches=1)."""
    return x.logp_old if x.has_proximal else sg(x.logp)


def _behaviour_weight(x: Prepared) -> Array:
    """w = π_old/μ (sg), value-clamped like every ratio; exactly 1 without a proximal policy."""
    if not x.has_proximal:
        return jnp.ones_like(x.logp)
    return jnp.exp(jnp.clip(x.logp_old - x.logp_mu, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def decoupled(x: Prepared, lo, hi, weight: Optional[Array],
              logp_old: Optional[Array] = None) -> Terms:
    """-sg(weight)·min(r·A, clip(r, lo, hi)·A) with r = π_θ/π_old (`logp_old`: x.logp_old
    unless given); weight None means 1."""
    r = ratio(x.logp - (x.logp_old if logp_old is None else logp_old))
    ell = clipped_surrogate(r, x.adv, lo, hi)
    if weight is not None:
        ell = sg(weight) * ell
    return Terms(ell=ell, clip_low=r < lo, clip_high=r > hi)


def decoupled_ppo(x: Prepared, eps_low: float, eps_high: float,
                  behave_cap: Optional[float]) -> Terms:
    """Decoupled PPO (AReaL, Fu et al. 2025): the trust region is around the proximal policy,
    the off-policyness of the behaviour policy is corrected by importance weighting:
    ℓ = -sg(w')·min(r·A, clip(r, 1-eps_low, 1+eps_high)·A), w' = w or min(w, behave_cap) (with a
    cap this is the "TIS on PPO" of verl/slime). Without a proximal policy, w = 1: plain PPO."""
    weight = None
    if x.has_proximal:
        weight = _behaviour_weight(x)
        if behave_cap is not None:
            weight = jnp.minimum(weight, behave_cap)
    return decoupled(x, *clip_range(eps_low, eps_high), weight)


def icepop(x: Prepared, eps_low: float, eps_high: float, band_low: float,
           band_high: float) -> Terms:
    """IcePop (Ring/Ling team, inclusionAI 2025): decoupled PPO whose behaviour weight is *masked*
    outside a band instead of truncated: w' = w if band_low ≤ w ≤ band_high else 0, so tokens
    whose trainer/sampler probabilities disagree badly contribute nothing (but still count in the
    normaliser). Without a proximal policy w = 1 and nothing is masked."""
    w = _behaviour_weight(x)
    in_band = (w >= band_low) & (w <= band_high)
    terms = decoupled(x, *clip_range(eps_low, eps_high), jnp.where(in_band, w, 0.0))
    return terms._replace(masked=~in_band)


def lag_scale(lag: Array, schedule: str, alpha) -> Array:
    """s(lag) ∈ (0, 1], 1 at lag 0: 1/(1+alpha·lag) ('inverse'), alpha^lag ('exp'), 1 ('constant')."""
    lag = lag.astype(jnp.float32)
    if schedule == "inverse":
        return 1.0 / (1.0 + alpha * lag)
    if schedule == "exp":
        return jnp.power(jnp.float32(alpha), lag)
    return jnp.ones_like(lag)


def staleness_clip(x: Prepared, eps_low: float, eps_high: float, cap: float, schedule: str,
                   alpha: float, lag_cutoff: Optional[int]) -> Terms:
    """Decoupled PPO whose behaviour-side trust region tightens with each token's lag.

    The behaviour weight w = π_prox/μ (π_θ/μ, held fixed, without a proximal policy) is
    truncated at a cap that falls with the token's lag from `cap` towards 1:
        c(lag) = 1 + (cap - 1)·s(lag),   w' = min(w, c(lag)),
        ℓ = -sg(w')·min(r·A, clip(r, 1-eps_low, 1+eps_high)·A),   r = π_θ/π_prox.
    Truncated importance weights (IMPALA's ρ̄, Espeholt et al. 2018) trade the bias of the cap
    for a variance bounded by it; the spread of w grows with the drift between μ and π, which
    grows with lag, so a fixed cap lets stale tokens carry more variance. Tightening the cap
    with lag bounds that (the second-moment argument of M2PO, 2025, applied per token through
    the cap; the 1/(1+alpha·lag) form is staleness-aware async SGD's step scaling, Zhang et
    al. 2016). At large lag no token is up-weighted (c → 1, V-trace's ρ̄ = 1). The proximal
    ratio keeps its usual clip. Without a proximal policy the current one (held fixed) stands
    in for it, so r is 1 in value and this is token-level TIS with the lag-dependent cap —
    which is also what the learner runs at minibatches=1, where π_prox = π_θ. Tokens with
    lag > lag_cutoff get ℓ = 0 and leave the normaliser. docs/losses.md derives it.
    """
    logp_prox = proximal_logp(x)
    w = jnp.exp(jnp.clip(logp_prox - x.logp_mu, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    bound = 1.0 + (jnp.float32(cap) - 1.0) * lag_scale(x.lag, schedule, alpha)
    capped = w > bound
    r = ratio(x.logp - logp_prox)
    lo, hi = clip_range(eps_low, eps_high)
    ell = sg(jnp.minimum(w, bound)) * clipped_surrogate(r, x.adv, lo, hi)
    n = jnp.maximum(jnp.sum(x.trained), 1)
    metrics = {"staleness_cap_frac": jnp.sum(capped & x.trained) / n,
               "staleness_cap_mean": jnp.sum(jnp.where(x.trained, bound, 0.0)) / n}
    terms = Terms(ell=ell, clip_low=r < lo, clip_high=(r > hi) | capped, metrics=metrics)
    if lag_cutoff is None:
        return terms
    excluded = x.lag > lag_cutoff
    return terms._replace(norm=jnp.where(excluded, 0.0, x.m), masked=excluded)


def cispo(x: Prepared, eps_low: Optional[float], eps_high: float) -> Terms:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, never the gradient —
    ℓ = -sg(clip(r, 1-eps_low, 1+eps_high))·A·log π_θ; eps_low None = no lower clip."""
    r = ratio(sg(x.logp - x.logp_old))
    lo = None if eps_low is None else 1.0 - eps_low
    hi = 1.0 + eps_high
    weight = jnp.clip(r, lo, hi)
    clip_low = jnp.zeros_like(x.trained) if lo is None else r < lo
    return Terms(ell=-weight * x.adv * x.logp, clip_low=clip_low, clip_high=r > hi)


def gspo(x: Prepared, eps_low: float, eps_high: float) -> Terms:
    """GSPO (Qwen team, Zheng et al. 2025): one length-normalised ratio per sequence,
    s = exp(Σ_t m·(log π_θ - log π_old) / Σ_t m), row term -min(s·A, clip(s, 1-eps_low,
    1+eps_high)·A) with A the advantage at the row's first trained token; the loss is the mean
    over rows with any trained token."""
    row_weight = jnp.sum(x.m, axis=1)
    has = row_weight > 0
    log_s = jnp.sum(x.m * (x.logp - x.logp_old), axis=1) / jnp.where(has, row_weight, 1.0)
    s = ratio(log_s)
    first = jnp.argmax(x.trained, axis=1)
    adv = jnp.take_along_axis(x.adv, first[:, None], axis=1)[:, 0]
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    row_term = clipped_surrogate(s, adv, lo, hi)
    loss = jnp.sum(jnp.where(has, row_term, 0.0)) / jnp.maximum(jnp.sum(has), 1)
    shape = x.logp.shape
    return Terms(loss=loss, clip_low=jnp.broadcast_to((s < lo)[:, None], shape),
                 clip_high=jnp.broadcast_to((s > hi)[:, None], shape),
                 metrics={"gspo_seq_ratio_mean": jnp.sum(jnp.where(has, sg(s), 0.0))
                          / jnp.maximum(jnp.sum(has), 1)})


def m2po_keep(d2: Array, trained: Array, tau: float) -> Array:
    """Tokens M2PO keeps: if the mean of d² over the trained tokens exceeds tau, drop the fewest
    largest d² until the mean of the rest is ≤ tau.

    Sort-free (a sort of B·T values costs ~70 ms on a CPU core): the kept set is {d² ≤ θ*} plus
    part of the ties at the next value. θ* is the largest θ with g(θ) = Σ_{d² ≤ θ}(d² - tau) ≤ 0;
    g ≤ 0 below tau and only grows above it, so θ* is found by bisection between tau and max d²
    over the int32 bit patterns of the non-negative float32 d² (they order like the floats): at
    most 31 passes over one int32 array. Dropped tokens all have d² > tau. Of the c tokens tied
    at the next value v, the first floor(-g(θ*)/(v - tau)) in row-major order are kept too.
    Every pass is a fused masked sum over the batch, which suits XLA on CPU, GPU and TPU.
    """
    tau = jnp.float32(tau)
    # Untrained tokens get the largest key: never at or below any threshold searched.
    key = jnp.where(trained, lax.bitcast_convert_type(jnp.maximum(d2, 0.0), jnp.int32),
                    jnp.iinfo(jnp.int32).max)

    def g(theta):
        return jnp.sum(jnp.where(key <= theta, lax.bitcast_convert_type(key, jnp.float32) - tau,
                                 0.0))

    def drop_some(_):
        def step(bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            ok = g(mid) <= 0
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        # Invariant g(lo) <= 0 < g(hi): g(tau) <= 0, and g(max d²) > 0 in this branch.
        top = jnp.max(jnp.where(trained, key, 0))
        lo, _ = lax.while_loop(lambda b: b[1] - b[0] > 1, step,
                               (lax.bitcast_convert_type(tau, jnp.int32), top))
        keep = key <= lo
        above = trained & ~keep
        v = jnp.min(jnp.where(above, d2, jnp.inf))
        tie = above & (d2 == v)
        n_ties = jnp.floor(-g(lo) / (v - tau))
        n_ties = jnp.clip(n_ties, 0, jnp.sum(tie)).astype(jnp.int32)

        def keep_first_ties(_):
            # The smallest row-major index I with n_ties tied tokens at or before it, again by
            # bisection (a cumsum compiles ~5x slower on XLA:CPU and this branch is rare).
            index = lax.broadcasted_iota(jnp.int32, tie.shape, 0) * tie.shape[1] \
                + lax.broadcasted_iota(jnp.int32, tie.shape, 1)

            def step(bounds):
                lo, hi = bounds  # count(index <= lo) < n_ties <= count(index <= hi)
                mid = lo + (hi - lo) // 2
                enough = jnp.sum(tie & (index <= mid)) >= n_ties
                return jnp.where(enough, lo, mid), jnp.where(enough, mid, hi)

            _, cut = lax.while_loop(lambda b: b[1] - b[0] > 1, step, (jnp.int32(-1), index.size))
            return keep | (tie & (index <= cut))

        return lax.cond(n_ties > 0, keep_first_ties, lambda _: keep, None)

    mean_exceeds = jnp.sum(jnp.where(trained, d2 - tau, 0.0)) > 0
    return lax.cond(mean_exceeds, drop_some, lambda _: trained, None)


def m2po_clip_bound(d2: Array, harmful: Array, tau) -> Array:
    """θ with mean over the harmful tokens of min(d², θ) = tau (+inf when their mean d² is
    already ≤ tau): the cap on d² that spends exactly the second-moment budget.

    Bisection over the int32 bit patterns of non-negative float32 θ (they order like the
    floats), 31 passes at most, each a fused masked sum; Σ min(d², θ) grows with θ."""
    tau = jnp.float32(tau)
    n = jnp.maximum(jnp.sum(harmful), 1).astype(jnp.float32)
    d2 = jnp.where(harmful, jnp.maximum(d2, 0.0), 0.0)

    def excess(theta_bits):
        theta = lax.bitcast_convert_type(theta_bits, jnp.float32)
        return jnp.sum(jnp.where(harmful, jnp.minimum(d2, theta), 0.0)) / n - tau

    def solve(_):
        def step(bounds):
            lo, hi = bounds  # excess(lo) <= 0 < excess(hi)
            mid = lo + (hi - lo) // 2
            ok = excess(mid) <= 0
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        top = lax.bitcast_convert_type(jnp.max(d2), jnp.int32)
        lo, _ = lax.while_loop(lambda b: b[1] - b[0] > 1, step, (jnp.int32(0), top))
        return lax.bitcast_convert_type(lo, jnp.float32)

    over = jnp.sum(d2) / n > tau
    return lax.cond(over, solve, lambda _: jnp.float32(jnp.inf), None)


def m2po(x: Prepared, tau: float, form: str, floor_low: Optional[float],
         floor_high: Optional[float]) -> Terms:
    """M2PO (second-moment trust policy optimisation, Zheng et al. 2025): bound the second
    moment of the log-ratio to the behaviour policy, d = sg(log π_θ - log μ), instead of
    clipping each ratio. Two forms:

    'paper' (the paper's text): drop (mask) the fewest tokens of largest d² so that the mean d²
    of the kept tokens M is ≤ tau; ℓ = -M·(π_θ/μ)·A.

    'released' (the authors' released code): the second moment is taken only over *harmful*
    tokens, whose ratio ρ = π_θ/μ moves against the advantage (A > 0 and ρ > 1, or A < 0 and
    ρ < 1). If their mean d² exceeds tau, a cap θ on d² that brings it to tau is found and
    turned into one PPO clip range for the batch, [e^-√θ, e^√θ]: ℓ = -min(ρ·A, clip(ρ, lo,
    hi)·A). Within budget nothing is clipped (ℓ = -ρ·A). Optionally (the released code's
    miniclip_low / miniclip_high, which the authors' training scripts leave unset) the range
    never tightens below the floor [1 - floor_low, 1 + floor_high]."""
    d = sg(x.logp - x.logp_mu)
    n = jnp.maximum(jnp.sum(x.trained), 1)
    d2_mean = jnp.sum(jnp.where(x.trained, d * d, 0.0)) / n
    if form == "released":
        rho = ratio(x.logp - x.logp_mu)
        harmful = x.trained & (((x.adv > 0) & (d > 0)) | ((x.adv < 0) & (d < 0)))
        theta = m2po_clip_bound(d * d, harmful, tau)
        half = jnp.sqrt(theta)
        lo, hi = jnp.exp(-half), jnp.exp(half)
        if floor_low is not None:
            lo = jnp.minimum(lo, 1.0 - jnp.float32(floor_low))
        if floor_high is not None:
            hi = jnp.maximum(hi, 1.0 + jnp.float32(floor_high))
        ell = clipped_surrogate(rho, x.adv, lo, hi)
        n_harm = jnp.maximum(jnp.sum(harmful), 1)
        return Terms(ell=ell, clip_low=rho < lo, clip_high=rho > hi,
                     metrics={"m2po_d2_mean": d2_mean,
                              "m2po_d2_mean_harmful": jnp.sum(jnp.where(harmful, d * d, 0.0))
                              / n_harm,
                              "m2po_clip_low": lo,
                              "m2po_clip_high": jnp.minimum(hi, jnp.float32(1e6))})
    keep = m2po_keep(d * d, x.trained, tau)
    ell = -jnp.where(keep, ratio(x.logp - x.logp_mu), 0.0) * x.adv
    return Terms(ell=ell, masked=~keep,
                 metrics={"m2po_d2_mean": d2_mean,
                          "m2po_d2_mean_kept": jnp.sum(jnp.where(keep, d * d, 0.0))
                          / jnp.maximum(jnp.sum(keep), 1)})
