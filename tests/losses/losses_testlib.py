"""Shared test inputs and a cache of compiled loss functions (compiles dominate test time)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.losses import LossInputs, get_loss, resolve_hparams

B, T = 5, 8
_CACHE = {}
TRACES = {}  # configuration key -> how many times its step function was traced


def make_inputs(seed=0, proximal=True, extras=False, lag_max=12):
    """dict of the LossInputs fields as NumPy arrays: ragged masks, row 3 fully masked, no token
    of lag 2 (an empty bucket), ratios wide enough that every clip and mask is exercised."""
    rng = np.random.default_rng(seed)
    mu = -rng.uniform(0.05, 3.0, (B, T))
    prox = mu + rng.normal(0.0, 0.6, (B, T))
    logp = prox + rng.normal(0.0, 0.25, (B, T))
    mask = (rng.uniform(size=(B, T)) < 0.75).astype(np.float32)
    mask[3] = 0.0
    mask[0, 0] = 1.0  # row 0 trains its first token
    lag = rng.integers(0, lag_max + 1, (B, T))
    lag[lag == 2] = 3
    out = {"logp": logp, "logp_behaviour": mu, "logp_proximal": prox if proximal else None,
           "advantages": rng.normal(0.0, 1.0, (B, T)), "loss_mask": mask, "lag": lag,
           "logp_ref": None, "entropy": None}
    if extras:
        out["logp_ref"] = logp + rng.normal(0.0, 0.3, (B, T))
        out["entropy"] = rng.exponential(1.0, (B, T))
    return out


def to_jax(inputs) -> LossInputs:
    def conv(k, v):
        if v is None:
            return None
        return jnp.asarray(v, jnp.int32 if k in ("lag", "engine") else jnp.float32)
    return LossInputs(**{k: conv(k, v) for k, v in inputs.items()})


def compiled(name, diagnostics=False, **hparams):
    """jit(value_and_grad) of get_loss(name, **hparams) w.r.t. logp: f(LossInputs) ->
    ((loss, metrics), grad). Cached per resolved configuration across the test session."""
    key = (name, diagnostics, tuple(sorted(resolve_hparams(name, **hparams).items())))
    if key not in _CACHE:
        loss_fn = get_loss(name, diagnostics=diagnostics, **hparams)

        def step(inputs):
            TRACES[key] = TRACES.get(key, 0) + 1  # runs only while tracing
            return jax.value_and_grad(lambda lp: loss_fn(inputs._replace(logp=lp)),
                                      has_aux=True)(inputs.logp)
        _CACHE[key] = jax.jit(step)
    return _CACHE[key]


def run_many(configs, inputs):
    """[(loss, grad)] in float64 for several (name, hparams) configurations on the same inputs,
    from ONE compilation (diagnostics off): compiles, not runs, dominate these tests' time."""
    key = ("many", tuple((name, tuple(sorted(hp.items()))) for name, hp in configs))
    if key not in _CACHE:
        fns = [get_loss(name, diagnostics=False, **hp) for name, hp in configs]

        def step(inputs):
            return [jax.value_and_grad(lambda lp, f=f: f(inputs._replace(logp=lp))[0])(
                inputs.logp) for f in fns]
        _CACHE[key] = jax.jit(step)
    return [(np.float64(loss), np.asarray(grad, np.float64))
            for loss, grad in _CACHE[key](to_jax(inputs))]


def traces(name, diagnostics=False, **hparams):
    return TRACES.get((name, diagnostics,
                       tuple(sorted(resolve_hparams(name, **hparams).items()))), 0)


def run(name, inputs, diagnostics=False, **hparams):
    """(loss, metrics, grad) as float64 NumPy, from a dict of NumPy inputs."""
    (loss, metrics), grad = compiled(name, diagnostics, **hparams)(to_jax(inputs))
    return (np.float64(loss), jax.tree.map(lambda a: np.asarray(a, np.float64), metrics),
            np.asarray(grad, np.float64))
