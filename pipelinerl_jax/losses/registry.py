"""`get_loss(name, **hparams)`: the registry of policy losses and their validated hyperparameters.

Every loss takes `agg` and `max_tokens` (except `gspo`, which is always a mean over rows) and
the KL penalty `kl_coef` / `kl_estimator`. Construction validates everything and fails with a
`ConfigError` keyed `loss.<hparam>` (or `loss.name`) that lists what is valid; the returned
function is pure and jittable: `loss_fn(LossInputs, hparams=None) -> (loss, metrics)`, its
numeric hyperparameters optionally traced inputs (`hparams`), so that a sweep over them
compiles once.

A loss also declares what it needs from the learner: `LossSpec.proximal` (its `logp_old` is
the proximal policy when one is given), so `learner.recompute_proximal='auto'` reads it here.
Adding a loss is one `LOSSES` entry; the ablation configs list the registry's losses.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.losses import diagnostics as off_policy
from pipelinerl_jax.losses import policy
from pipelinerl_jax.losses.a3po import a3po
from pipelinerl_jax.losses.opsm import opsm
from pipelinerl_jax.losses.seq_is import LEVELS, MODES, seq_is
from pipelinerl_jax.losses.vcpo import BASELINES, SCALINGS, vcpo
from pipelinerl_jax.losses.core import (AGGREGATIONS, KL_ESTIMATORS, LossInputs, aggregate,
                                        kl_to_reference, prepare, sg)


def _number(lo=None, hi=None, lo_open=False, hi_open=False, optional=False, integer=False):
    def check(v):
        if v is None:
            return None if optional else "must be set (None is not allowed)"
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            return f"must be {'an integer' if integer else 'a number'}, got {v!r}"
        if not math.isfinite(v):
            return f"must be finite, got {v!r}"
        if lo is not None and (v < lo or (lo_open and v == lo)):
            return f"must be {'>' if lo_open else '>='} {lo}, got {v!r}"
        if hi is not None and (v > hi or (hi_open and v == hi)):
            return f"must be {'<' if hi_open else '<='} {hi}, got {v!r}"
        return None
    return check


def _choice(options):
    def check(v):
        return None if v in options else f"must be one of {list(options)}, got {v!r}"
    return check


@dataclasses.dataclass(frozen=True)
class HParam:
    default: Any
    type: type  # the ml_collections placeholder type
    check: Callable[[Any], Optional[str]]  # an error message, or None when valid


@dataclasses.dataclass(frozen=True)
class LossSpec:
    fn: Callable  # (Prepared, **hparams) -> policy.Terms
    hparams: dict
    aggregated: bool = True  # takes `agg` / `max_tokens`
    proximal: bool = False  # `logp_old` is `logp_proximal` when given (decoupled objectives)
    step_scale: bool = False  # metrics["step_scale"] multiplies the optimizer's update


_EPS_LOW = HParam(0.2, float, _number(0, 1, hi_open=True))
_EPS_HIGH = HParam(0.2, float, _number(0))

LOSSES = {
    "reinforce": LossSpec(policy.reinforce, {}),
    "ppo": LossSpec(policy.ppo, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        "dual_clip": HParam(None, float, _number(1, lo_open=True, optional=True))}),
    "tis": LossSpec(policy.tis, {
        "cap": HParam(2.0, float, _number(0, lo_open=True)),
        "level": HParam("token", str, _choice(("token", "sequence")))}),
    "decoupled_ppo": LossSpec(policy.decoupled_ppo, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        "behave_cap": HParam(None, float, _number(0, lo_open=True, optional=True))},
        proximal=True),
    "icepop": LossSpec(policy.icepop, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        # The band must contain 1: an on-policy token (w = 1) is never masked.
        "band_low": HParam(0.5, float, _number(0, 1)),
        "band_high": HParam(5.0, float, _number(1))}, proximal=True),
    "staleness_clip": LossSpec(policy.staleness_clip, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        # The behaviour weight's cap at lag 0; it falls towards 1 with lag (>= 1: an
        # on-policy token, w = 1, is never cut).
        "cap": HParam(2.0, float, _number(1)),
        "schedule": HParam("inverse", str, _choice(("inverse", "exp", "constant"))),
        "alpha": HParam(0.5, float, _number(0)),
        "lag_cutoff": HParam(None, int, _number(0, optional=True, integer=True))},
        proximal=True),
    "cispo": LossSpec(policy.cispo, {
        "eps_low": HParam(None, float, _number(0, 1, hi_open=True, optional=True)),
        "eps_high": HParam(5.0, float, _number(0))}),
    "gspo": LossSpec(policy.gspo, {
        "eps_low": HParam(3e-4, float, _number(0, 1, hi_open=True)),
        "eps_high": HParam(4e-4, float, _number(0))}, aggregated=False),
    "m2po": LossSpec(policy.m2po, {
        "tau": HParam(0.04, float, _number(0, lo_open=True)),
        "form": HParam("paper", str, _choice(("paper", "released"))),
        # The released code's optional floor on its clip range (its miniclip_low /
        # miniclip_high): unset, as in the authors' training scripts (their actor passes
        # config.get("miniclip_low", None) and no script sets it); 0.3 / 0.5 is the floor
        # their loss function's signature defaults to.
        "floor_low": HParam(None, float, _number(0, 1, optional=True)),
        "floor_high": HParam(None, float, _number(0, optional=True))}),
    "seq_is": LossSpec(seq_is, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        "level": HParam("sequence", str, _choice(LEVELS)),
        "mode": HParam("truncate", str, _choice(MODES)),
        # [low, high] must contain 1: on-policy data (weight 1) is never cut or masked.
        "high": HParam(2.0, float, _number(1)),
        "low": HParam(None, float, _number(0, 1, lo_open=True, optional=True)),
        "veto": HParam(None, float, _number(0, 1, lo_open=True, optional=True))},
        proximal=True),
    "opsm": LossSpec(opsm, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        "delta": HParam(0.1, float, _number(0))}),
    "a3po": LossSpec(a3po, {
        "eps_low": _EPS_LOW, "eps_high": _EPS_HIGH,
        "behave_cap": HParam(None, float, _number(0, lo_open=True, optional=True))}),
    "vcpo": LossSpec(vcpo, {
        "cap": HParam(8.0, float, _number(0, lo_open=True)),
        "ess_base": HParam(1.0, float, _number(0, 1, lo_open=True)),
        "scaling": HParam("sqrt", str, _choice(SCALINGS)),
        # The off-policy optimal baseline, applied by the train step; 'opob' as the authors
        # ran it (every VCPO script enables it), 'none' the ESS-scaled step alone.
        "baseline": HParam("opob", str, _choice(BASELINES))}, proximal=True, step_scale=True),
}

AGG_HPARAMS = {
    "agg": HParam("token_mean", str, _choice(AGGREGATIONS)),
    "max_tokens": HParam(None, int, _number(1, optional=True, integer=True)),
}
KL_HPARAMS = {
    "kl_coef": HParam(0.0, float, _number(0)),
    "kl_estimator": HParam("k3", str, _choice(KL_ESTIMATORS)),
}


def hparams_of(name: str) -> dict:
    """name -> HParam of every hyperparameter loss `name` accepts."""
    if name not in LOSSES:
        raise ConfigError("loss.name", f"unknown loss {name!r}; valid: {sorted(LOSSES)}")
    spec = LOSSES[name]
    return {**spec.hparams, **(AGG_HPARAMS if spec.aggregated else {}), **KL_HPARAMS}


def needs_proximal(name: str) -> bool:
    """Whether loss `name` uses the proximal policy (its `logp_old`) when one is given."""
    if name not in LOSSES:
        raise ConfigError("loss.name", f"unknown loss {name!r}; valid: {sorted(LOSSES)}")
    return LOSSES[name].proximal


def resolve_hparams(name: str, **hparams) -> dict:
    """Validated hyperparameters of loss `name`, defaults filled in; ConfigError otherwise."""
    valid = hparams_of(name)
    for key in hparams:
        if key not in valid:
            raise ConfigError(f"loss.{key}", f"is not a hyperparameter of loss {name!r}; "
                                             f"its hyperparameters: {sorted(valid)}")
    hp = {key: hparams.get(key, p.default) for key, p in valid.items()}
    for key, p in valid.items():
        error = p.check(hp[key])
        if error:
            raise ConfigError(f"loss.{key}", error)
    if "agg" in hp:
        if hp["agg"] == "constant" and hp["max_tokens"] is None:
            raise ConfigError("loss.max_tokens", "agg='constant' divides by B·max_tokens; set "
                                                 "it (e.g. the maximum completion length)")
        if hp["agg"] != "constant" and hp["max_tokens"] is not None:
            raise ConfigError("loss.max_tokens", f"is only used with agg='constant', "
                                                 f"not agg={hp['agg']!r}")
    if name == "seq_is" and hp["mode"] == "truncate" and hp["low"] is not None:
        raise ConfigError("loss.low", "is the lower bound of mode='mask'; mode='truncate' "
                                      "only caps the weight at loss.high")
    if name == "staleness_clip" and hp["schedule"] == "exp" and hp["alpha"] > 1:
        raise ConfigError("loss.alpha", f"schedule='exp' scales the cap's excess over 1 by "
                                        f"alpha^lag and needs 0 <= alpha <= 1, got "
                                        f"{hp['alpha']!r}")
    return hp


def _check_shapes(inputs: LossInputs) -> None:
    shape = inputs.logp.shape
    if len(shape) != 2:
        raise ValueError(f"LossInputs.logp: must be [B, T], got shape {shape}")
    for field, value in inputs._asdict().items():
        if value is not None and value.shape != shape:
            raise ValueError(f"LossInputs.{field}: shape {value.shape} != logp's {shape}")


def traced_values(hp: dict) -> dict:
    """The numeric hyperparameters of resolved `hp` (name -> float): what a loss takes as
    traced inputs. Strings (agg, level, schedule, kl_estimator) and unset optional numbers
    (None) are structural and stay compile-time constants."""
    return {k: float(v) for k, v in hp.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def get_loss(name: str, *, diagnostics: bool = True,
             **hparams) -> Callable[..., tuple]:
    """The loss `name` with `hparams` (defaults for the rest), as a pure jittable function
    `loss_fn(inputs: LossInputs, hparams=None) -> (scalar loss, metrics: dict[str, Array])`.

    The loss is the aggregated policy term plus `kl_coef` times the aggregated KL estimate to
    `inputs.logp_ref` (a non-zero kl_coef requires logp_ref). `metrics` holds `loss`, `pg_loss`,
    `kl_ref` (when logp_ref is given), the loss's own metrics and, unless `diagnostics=False`
    (e.g. for all but one micro-batch of an accumulated step), every off-policy diagnostic of
    `diagnostics.compute` (per-lag-bucket ones as `lag/<name>` float32[6] vectors; see
    `diagnostics.flatten_metrics`). `loss_fn.name` / `loss_fn.hparams` (resolved: defaults
    filled in) / `loss_fn.needs_proximal` / `loss_fn.scales_step` (the update is to be
    multiplied by `metrics["step_scale"]`) / `loss_fn.baseline` ('none', or the form of VCPO's
    off-policy optimal baseline the train step subtracts from the advantages) record what was
    built, for the learner to read.

    `loss_fn.traced_hparams` (name -> float) are its numeric hyperparameters (clip ranges,
    caps, tau, kl_coef, ...). The call's `hparams` (a dict of some of those names, e.g. float32
    scalars traced by jit) replaces their values, so one compiled function serves every value;
    without it they are the constants given here. Whether the KL term is added at all is
    decided here (kl_coef > 0), as are the structural choices; passed values are not
    re-validated.
    """
    hp = resolve_hparams(name, **hparams)
    spec = LOSSES[name]
    traced = traced_values(hp)
    agg = hp.get("agg", "seq_mean_token_mean")
    use_kl = hp["kl_coef"] > 0

    def loss_fn(inputs: LossInputs, hparams: Optional[dict] = None):
        _check_shapes(inputs)
        values = dict(hp)
        if hparams:
            unknown = set(hparams) - set(traced)
            if unknown:
                raise ValueError(f"loss {name!r}: {sorted(unknown)} are not traced "
                                 f"hyperparameters of it; those are {sorted(traced)}")
            values.update(hparams)
        x = prepare(inputs)
        terms = spec.fn(x, **{key: values[key] for key in spec.hparams})
        norm = x.m if terms.norm is None else terms.norm
        max_tokens = values.get("max_tokens")
        pg = terms.loss if terms.loss is not None else aggregate(terms.ell, norm, agg, max_tokens)
        loss, metrics = pg, {}
        if inputs.logp_ref is not None:
            ref = jnp.where(x.trained, jnp.asarray(inputs.logp_ref, jnp.float32), 0.0)
            kl = aggregate(kl_to_reference(x.logp, ref, hp["kl_estimator"]), norm, agg,
                           max_tokens)
            metrics["kl_ref"] = sg(kl)
            if use_kl:
                loss = loss + values["kl_coef"] * kl
        elif use_kl:
            raise ConfigError("loss.kl_coef", f"is {hp['kl_coef']} but LossInputs.logp_ref is "
                                              f"None; pass reference log-probs or set 0")
        metrics.update(loss=sg(loss), pg_loss=sg(pg))
        metrics.update({k: sg(v) for k, v in (terms.metrics or {}).items()})
        if diagnostics:
            # The barrier keeps XLA from fusing the diagnostics into the loss's forward and
            # backward pass; fused, they re-materialised shared intermediates and PPO-like
            # losses ran ~3x slower on CPU (scripts/bench_losses.py). The diagnostics re-clean
            # the raw inputs behind it: passing the loss's cleaned arrays through was as slow.
            raw, clips = jax.lax.optimization_barrier(
                sg((inputs, (terms.clip_low, terms.clip_high, terms.masked))))
            metrics.update(off_policy.compute(prepare(raw), *clips, raw.entropy, raw.engine))
        return loss, metrics

    loss_fn.name = name
    loss_fn.hparams = dict(hp)
    loss_fn.traced_hparams = traced
    loss_fn.needs_proximal = spec.proximal
    loss_fn.scales_step = spec.step_scale
    loss_fn.baseline = hp.get("baseline", "none")  # 'none' or VCPO's OPOB form (train step)
    return loss_fn
