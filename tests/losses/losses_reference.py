"""Independent float64 NumPy reference of DESIGN.md "Loss specification" (tests only).

Written from the spec, not from the JAX code: every loss gives, per token, its term ℓ and the
hand-derived derivative dℓ/dlogp (quantities under sg held fixed), and the aggregation gives
each token's coefficient c so that loss = Σ c·ℓ and grad = c·dℓ/dlogp. `value(...)` evaluates
the loss with the sg quantities frozen at `frozen_logp`, so finite differences of it check the
hand-written gradients.
"""
from __future__ import annotations

import numpy as np

BUCKET_EDGES = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 10**9))
BUCKET_NAMES = ("0", "1", "2", "3-4", "5-8", "9+")
DEFAULTS = {
    "reinforce": {},
    "ppo": {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None},
    "tis": {"cap": 2.0, "level": "token"},
    "decoupled_ppo": {"eps_low": 0.2, "eps_high": 0.2, "behave_cap": None},
    "icepop": {"eps_low": 0.2, "eps_high": 0.2, "band_low": 0.5, "band_high": 5.0},
    "staleness_clip": {"eps_low": 0.2, "eps_high": 0.2, "cap": 2.0, "schedule": "inverse",
                       "alpha": 0.5, "lag_cutoff": None},
    "cispo": {"eps_low": None, "eps_high": 5.0},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
    "m2po": {"tau": 0.04, "form": "paper", "floor_low": None, "floor_high": None},
}


def _ppo_token(r, adv, lo, hi):
    """-min(r·A, clip(r)·A) and its derivative w.r.t. logp (r = exp(logp - old))."""
    unclipped, clipped = r * adv, np.clip(r, lo, hi) * adv
    take_unclipped = unclipped <= clipped  # equal inside the range: same value and slope
    ell = -np.where(take_unclipped, unclipped, clipped)
    dell = np.where(take_unclipped, -r * adv, 0.0)  # clip(r) is constant outside the range
    return ell, dell


def _m2po_keep(d2, trained, tau):
    keep = trained.copy()
    idx = np.flatnonzero(trained.ravel())
    vals = d2.ravel()[idx]
    # Largest d² first; among equal d² the later token (row-major) is dropped first.
    order = idx[np.lexsort((-idx, -vals))]
    rest = d2.ravel()[order]
    k = 0
    while k < len(rest) and rest[k:].mean() > tau:
        k += 1
    flat = keep.ravel()
    flat[order[:k]] = False
    return flat.reshape(trained.shape)


def _m2po_cap(d2, harmful, tau):
    """The exact θ with mean over harmful tokens of min(d², θ) = tau (inf if within budget)."""
    v = np.sort(d2[harmful])
    n = len(v)
    if n == 0 or v.mean() <= tau:
        return np.inf
    below = 0.0
    for k in range(n):  # θ in [v[k-1], v[k]]: Σ_{i<k} v_i + (n-k)·θ = tau·n
        theta = (tau * n - below) / (n - k)
        if theta <= v[k]:
            return theta
        below += v[k]
    return np.inf


def _coefficients(norm, agg, max_tokens):
    """c with loss = Σ c·ℓ for aggregation `agg` over the normaliser mask `norm`."""
    if agg == "token_mean":
        return norm / max(norm.sum(), 1e-300) if norm.sum() > 0 else np.zeros_like(norm)
    if agg == "constant":
        return norm / (norm.shape[0] * max_tokens)
    row = norm.sum(axis=1, keepdims=True)
    rows = max((row[:, 0] > 0).sum(), 1)
    if agg == "seq_mean_token_sum":
        return np.where(row > 0, norm, 0.0) / rows
    if agg == "seq_mean_token_mean":
        return np.where(row > 0, norm / np.where(row > 0, row, 1.0), 0.0) / rows
    raise ValueError(agg)


def terms(name, hp, logp, frozen, mu, old, adv, m, lag, has_proximal=True):
    """(ℓ, dℓ/dlogp, normaliser) per token for the token-level losses."""
    t = m > 0
    norm = m.copy()
    if name == "reinforce":
        return -adv * logp, -adv, norm
    if name == "ppo":
        r = np.exp(logp - old)
        ell, dell = _ppo_token(r, adv, 1 - hp["eps_low"], 1 + hp["eps_high"])
        if hp["dual_clip"] is not None:
            bound = -hp["dual_clip"] * adv
            dual = (adv < 0) & (bound < ell)
            ell, dell = np.where(dual, bound, ell), np.where(dual, 0.0, dell)
        return ell, dell, norm
    if name == "tis":
        log_rho = frozen - mu
        if hp["level"] == "sequence":
            log_rho = np.repeat((m * log_rho).sum(axis=1, keepdims=True), logp.shape[1], 1)
        weight = np.minimum(np.exp(log_rho), hp["cap"])
        return -weight * adv * logp, -weight * adv, norm
    if name == "staleness_clip":
        # Without a proximal policy the current one, held fixed, stands in for it.
        prox = old if has_proximal else frozen
        s = {"inverse": 1.0 / (1.0 + hp["alpha"] * lag),
             "exp": hp["alpha"] ** lag.astype(float),
             "constant": np.ones_like(logp)}[hp["schedule"]]
        w = np.minimum(np.exp(prox - mu), 1.0 + (hp["cap"] - 1.0) * s)
        if hp["lag_cutoff"] is not None:
            norm = np.where(lag > hp["lag_cutoff"], 0.0, m)
        ell, dell = _ppo_token(np.exp(logp - prox), adv, 1 - hp["eps_low"], 1 + hp["eps_high"])
        return w * ell, w * dell, norm
    if name in ("decoupled_ppo", "icepop"):
        w = np.exp(old - mu)
        if name == "decoupled_ppo" and hp["behave_cap"] is not None:
            w = np.minimum(w, hp["behave_cap"])
        if name == "icepop":
            w = np.where((w >= hp["band_low"]) & (w <= hp["band_high"]), w, 0.0)
        r = np.exp(logp - old)
        ell, dell = _ppo_token(r, adv, 1 - hp["eps_low"], 1 + hp["eps_high"])
        return w * ell, w * dell, norm
    if name == "cispo":
        r = np.exp(frozen - old)
        lo = -np.inf if hp["eps_low"] is None else 1 - hp["eps_low"]
        weight = np.clip(r, lo, 1 + hp["eps_high"])
        return -weight * adv * logp, -weight * adv, norm
    if name == "m2po" and hp["form"] == "released":
        d = frozen - mu
        harmful = t & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
        half = np.sqrt(_m2po_cap(d * d, harmful, hp["tau"]))
        lo, hi = np.exp(-half), np.exp(half)
        if hp["floor_low"] is not None:
            lo = min(lo, 1 - hp["floor_low"])
        if hp["floor_high"] is not None:
            hi = max(hi, 1 + hp["floor_high"])
        ell, dell = _ppo_token(np.exp(logp - mu), adv, lo, hi)
        return ell, dell, norm
    if name == "m2po":
        d = frozen - mu
        keep = _m2po_keep(np.where(t, d * d, 0.0), t, hp["tau"]).astype(float)
        rho = np.exp(logp - mu)
        return -keep * rho * adv, -keep * rho * adv, norm
    raise ValueError(name)


def gspo(hp, logp, old, adv, m):
    """(loss, grad) of GSPO: mean over rows with trained tokens of the clipped row term."""
    n = m.sum(axis=1)
    has = n > 0
    safe = np.where(has, n, 1.0)
    s = np.exp((m * (logp - old)).sum(axis=1) / safe)
    first = np.argmax(m > 0, axis=1)
    a = adv[np.arange(len(adv)), first]
    unclipped, clipped = s * a, np.clip(s, 1 - hp["eps_low"], 1 + hp["eps_high"]) * a
    take = unclipped <= clipped
    row = -np.where(take, unclipped, clipped)
    rows = max(has.sum(), 1)
    loss = np.where(has, row, 0.0).sum() / rows
    drow = np.where(take & has, -a * s, 0.0)[:, None] * m / safe[:, None]  # d(row)/d logp_t
    return loss, drow / rows


def kl_terms(logp, ref, estimator):
    delta = ref - logp
    if estimator == "k1":
        return -delta, np.ones_like(logp)
    if estimator == "k2":
        return 0.5 * delta ** 2, -delta
    return np.exp(delta) - 1 - delta, 1 - np.exp(delta)


def loss_and_grad(name, hparams, inputs, frozen=None):
    """Reference (loss, d loss / d logp) in float64. `inputs`: dict of the LossInputs fields."""
    hp = {**DEFAULTS[name], **{k: v for k, v in hparams.items()
                               if k not in ("agg", "max_tokens", "kl_coef", "kl_estimator")}}
    f64 = {k: None if v is None else np.asarray(v, np.float64) for k, v in inputs.items()}
    m = np.where(f64["loss_mask"] > 0, f64["loss_mask"], 0.0)
    t = m > 0

    def clean(a):
        return np.where(t, a, 0.0)

    logp, mu, adv = clean(f64["logp"]), clean(f64["logp_behaviour"]), clean(f64["advantages"])
    old = mu if f64["logp_proximal"] is None else clean(f64["logp_proximal"])
    lag = np.where(t, np.asarray(inputs["lag"]), 0)
    frozen = logp if frozen is None else clean(np.asarray(frozen, np.float64))
    agg, max_tokens = hparams.get("agg", "token_mean"), hparams.get("max_tokens")
    if name == "gspo":
        loss, grad = gspo(hp, logp, old, adv, m)
        norm, agg = m, "seq_mean_token_mean"
    else:
        ell, dell, norm = terms(name, hp, logp, frozen, mu, old, adv, m, lag,
                                has_proximal=f64["logp_proximal"] is not None)
        c = _coefficients(norm, agg, max_tokens)
        loss, grad = (c * ell).sum(), c * dell
    if inputs.get("logp_ref") is not None and hparams.get("kl_coef", 0.0) > 0:
        kl, dkl = kl_terms(logp, clean(f64["logp_ref"]), hparams.get("kl_estimator", "k3"))
        c = _coefficients(norm, agg, max_tokens)
        loss, grad = loss + hparams["kl_coef"] * (c * kl).sum(), grad + hparams["kl_coef"] * c * dkl
    return loss, np.where(t, grad, 0.0)


def diagnostics(inputs, clip_low=None, clip_high=None, masked=None):
    """Reference diagnostics: overall scalars and, per bucket name, a dict of the same."""
    f64 = {k: None if v is None else np.asarray(v, np.float64) for k, v in inputs.items()}
    t = f64["loss_mask"] > 0
    logp, mu = f64["logp"], f64["logp_behaviour"]
    old = mu if f64["logp_proximal"] is None else f64["logp_proximal"]
    lag, adv = np.asarray(inputs["lag"]), f64["advantages"]
    none = np.zeros_like(t)
    low = none if clip_low is None else clip_low
    high = none if clip_high is None else clip_high
    masked = none if masked is None else masked

    def stats(sel):
        n = sel.sum()
        if n == 0:
            return {"tokens": 0.0, "ess": 0.0, "r_mean": 0.0, "kl_k1": 0.0}
        rho = np.exp(logp - mu)[sel]
        r, w = np.exp(logp - old)[sel], np.exp(old - mu)[sel]
        out = {"tokens": float(n), "ess": rho.sum() ** 2 / (n * (rho ** 2).sum()),
               "r_mean": r.mean(), "r_min": r.min(), "r_max": r.max(),
               "w_mean": w.mean(), "w_min": w.min(), "w_max": w.max(),
               "kl_k1": (-np.log(rho)).mean(), "kl_k3": (rho - 1 - np.log(rho)).mean(),
               "clip_low_frac_pos_adv": (low & (adv > 0))[sel].mean(),
               "clip_low_frac_neg_adv": (low & (adv < 0))[sel].mean(),
               "clip_high_frac_pos_adv": (high & (adv > 0))[sel].mean(),
               "clip_high_frac_neg_adv": (high & (adv < 0))[sel].mean(),
               "masked_frac": masked[sel].mean()}
        # The mismatch: the weights the update starts from (proximal, else current) vs μ.
        dd = ((logp if f64["logp_proximal"] is None else old) - mu)[sel]
        out.update({"mismatch_abs_mean": np.abs(dd).mean(), "mismatch_abs_max": np.abs(dd).max(),
                    "mismatch_frac_above_0.1": (np.abs(dd) > 0.1).mean(),
                    "mismatch_kl_k3": (np.exp(dd) - 1 - dd).mean()})
        # Tokens with A = 0 count in no clip fraction (their loss is 0 whatever the ratio).
        out["clip_frac"] = sum(out[k] for k in out if k.startswith("clip_"))
        if inputs.get("entropy") is not None:
            out["entropy"] = f64["entropy"][sel].mean()
        return out

    overall = stats(t)
    lag_t = np.where(t, lag, 0)
    overall["lag_mean"], overall["lag_max"] = lag_t[t].mean(), lag_t.max()
    rows = t.any(axis=1)
    log_w = (np.where(t, f64["loss_mask"], 0) * np.where(t, logp - mu, 0)).sum(axis=1)[rows]
    w = np.exp(log_w - log_w.max())
    overall["seq_ess"] = w.sum() ** 2 / (rows.sum() * (w ** 2).sum())
    buckets = {name: stats(t & (lag >= lo) & (lag <= hi))
               for name, (lo, hi) in zip(BUCKET_NAMES, BUCKET_EDGES)}
    return overall, buckets
