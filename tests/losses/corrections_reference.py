"""Independent float64 NumPy oracles of the sequence-level corrections (tests only), written
from each source's formula (module docstrings of losses/seq_is, opsm, a3po, vcpo cite them),
not from the JAX code.

Each returns per token (ℓ, dℓ/dlogp, normaliser) with every quantity under sg computed from
`frozen` (the current log-probs held fixed) or the other inputs, plus VCPO's step scale.
`prox` is the proximal log-probs, or None (then the current policy, held fixed, stands in).
"""
from __future__ import annotations

import numpy as np

from tests.losses.losses_reference import _coefficients, _ppo_token

DEFAULTS = {
    "seq_is": {"eps_low": 0.2, "eps_high": 0.2, "level": "sequence", "mode": "truncate",
               "high": 2.0, "low": None, "veto": None},
    "opsm": {"eps_low": 0.2, "eps_high": 0.2, "delta": 0.1},
    "a3po": {"eps_low": 0.2, "eps_high": 0.2, "behave_cap": None},
    "vcpo": {"cap": 8.0, "ess_base": 1.0, "scaling": "sqrt"},
}


def _row_log_weight(d, m, level):
    if level == "token":
        return np.clip(d, -20, 20)
    total = (m * d).sum(axis=1, keepdims=True)
    if level == "geometric":
        total = total / np.maximum(m.sum(axis=1, keepdims=True), 1)
    return np.clip(np.repeat(total, d.shape[1], axis=1), -20, 20)


def seq_is(hp, logp, frozen, mu, prox, adv, m, lag):
    p = frozen if prox is None else prox
    d = p - mu
    log_w = _row_log_weight(d, m, hp["level"])
    norm = m.copy()
    if hp["mode"] == "truncate":
        w = np.minimum(np.exp(log_w), hp["high"])
    else:
        low = 1.0 / hp["high"] if hp["low"] is None else hp["low"]
        out = (np.exp(log_w) < low) | (np.exp(log_w) > hp["high"])
        w = np.where(out, 0.0, np.exp(log_w))
        norm = np.where(out, 0.0, norm)
    if hp["veto"] is not None:
        row_vetoed = ((m > 0) & (np.exp(d) < hp["veto"])).any(axis=1, keepdims=True)
        w = np.where(row_vetoed, 0.0, w)
        norm = np.where(row_vetoed, 0.0, norm)
    ell, dell = _ppo_token(np.exp(logp - p), adv, 1 - hp["eps_low"], 1 + hp["eps_high"])
    return w * ell, w * dell, norm


def opsm(hp, logp, frozen, mu, prox, adv, m, lag):
    old = mu  # DeepSeek's π_old: the sampler's log-probs
    n = m.sum(axis=1, keepdims=True)
    kl = (m * (mu - frozen)).sum(axis=1, keepdims=True) / np.maximum(n, 1)
    keep = ~((adv < 0) & (kl > hp["delta"]))
    ell, dell = _ppo_token(np.exp(logp - old), adv, 1 - hp["eps_low"], 1 + hp["eps_high"])
    return keep * ell, keep * dell, m.copy()


def a3po(hp, logp, frozen, mu, prox, adv, m, lag):
    # AReaL: v_prox = v_theta - 1, alpha = (v_prox - v_mu)/(v_theta - v_mu), lag = v_theta - v_mu.
    v_theta = 100.0
    v_mu = v_theta - lag
    diff = v_theta - v_mu
    alpha = np.where(diff > 0, (v_theta - 1 - v_mu) / np.where(diff > 0, diff, 1), 0.0)
    alpha = np.clip(alpha, 0, 1)
    p = mu + alpha * (frozen - mu)
    w = np.exp(p - mu)
    if hp["behave_cap"] is not None:
        w = np.minimum(w, hp["behave_cap"])
    ell, dell = _ppo_token(np.exp(logp - p), adv, 1 - hp["eps_low"], 1 + hp["eps_high"])
    return w * ell, w * dell, m.copy()


def vcpo(hp, logp, frozen, mu, prox, adv, m, lag):
    p = frozen if prox is None else prox
    seq = (m * (p - mu)).sum(axis=1)
    w = np.minimum(np.exp(seq), hp["cap"])[:, None]
    r = np.exp(logp - p)
    return -w * r * adv, -w * r * adv, m.copy()


def step_scale(hp, frozen, mu, prox, m):
    """VCPO: sqrt (or linear) of min(1, (ESS/B)/ess_base), ESS over rows with trained tokens
    of the unclipped sequence weights (the authors' compute_ess_info)."""
    p = frozen if prox is None else prox
    has = m.sum(axis=1) > 0
    w = np.exp((m * (p - mu)).sum(axis=1))[has]
    ratio = w.sum() ** 2 / (w * w).sum() / len(w)
    frac = min(1.0, ratio / hp["ess_base"])
    return np.sqrt(frac) if hp["scaling"] == "sqrt" else frac


ORACLES = {"seq_is": seq_is, "opsm": opsm, "a3po": a3po, "vcpo": vcpo}


def loss_and_grad(name, hparams, logp, mu, prox, adv, m, lag, frozen=None, agg="token_mean"):
    """(loss, d loss/d logp) in float64 of correction `name` (token_mean unless `agg`)."""
    hp = {**DEFAULTS[name], **hparams}
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    m = np.where(f(m) > 0, f(m), 0.0)
    t = m > 0
    clean = lambda a: None if a is None else np.where(t, f(a), 0.0)  # noqa: E731
    logp, mu, prox, adv = clean(logp), clean(mu), clean(prox), clean(adv)
    frozen = logp if frozen is None else clean(frozen)
    lag = np.where(t, np.asarray(lag), 0)
    ell, dell, norm = ORACLES[name](hp, logp, frozen, mu, prox, adv, m, lag)
    c = _coefficients(norm, agg, None)
    return (c * ell).sum(), np.where(t, c * dell, 0.0)
