"""Cost of each off-policy correction relative to the plain policy gradient.

Per loss: the median wall time of one jitted forward + backward (gradient w.r.t. logp, every
diagnostic included) over a [B, T] batch, after warmup, and its ratio to `reinforce`. Also the
time of the loss-independent diagnostics alone. Inputs are staleness-like: a proximal policy,
lags 0..12, ragged rows, and log-ratios wide enough that m2po has to drop tokens.

    PYTHONPATH=. python scripts/bench_losses.py [--batch 256 --seq 1024 --repeats 20]

Prints a table, then ONE final JSON line.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.losses import LOSSES, LossInputs, get_loss, off_policy_diagnostics


def make_inputs(batch: int, seq: int, seed: int = 0) -> LossInputs:
    rng = np.random.default_rng(seed)
    logp_mu = -rng.exponential(1.0, (batch, seq))
    logp_prox = logp_mu + rng.normal(0, 0.2, (batch, seq))
    logp = logp_prox + rng.normal(0, 0.1, (batch, seq))
    lengths = rng.integers(seq // 8, seq + 1, batch)
    mask = np.arange(seq)[None, :] < lengths[:, None]
    adv = np.repeat(rng.normal(size=(batch, 1)), seq, axis=1)
    lag = np.repeat(rng.integers(0, 13, (batch, 1)), seq, axis=1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return LossInputs(f32(logp), f32(logp_mu), f32(logp_prox), f32(adv), f32(mask),
                      jnp.asarray(lag, jnp.int32), entropy=f32(rng.exponential(1.0, logp.shape)))


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    inputs = make_inputs(args.batch, args.seq)
    ms = {}
    for name in LOSSES:
        loss_fn = get_loss(name)
        step = jax.jit(jax.value_and_grad(
            lambda logp, rest, f=loss_fn: f(rest._replace(logp=logp)), has_aux=True))
        ms[name] = median_ms(step, (inputs.logp, inputs), args.repeats)
    diag_ms = median_ms(jax.jit(off_policy_diagnostics), (inputs,), args.repeats)
    ratio = {name: ms[name] / ms["reinforce"] for name in ms}

    print(f"{'loss':16s} {'ms':>8s} {'x reinforce':>12s}")
    for name in ms:
        print(f"{name:16s} {ms[name]:8.2f} {ratio[name]:12.2f}")
    print(f"{'(diagnostics)':16s} {diag_ms:8.2f}")
    print(json.dumps({
        "bench": "losses", "shape": [args.batch, args.seq], "repeats": args.repeats,
        "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
        "cpu": platform.processor() or platform.machine(),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "ratio_to_reinforce": {k: round(v, 3) for k, v in ratio.items()},
        "diagnostics_ms": round(diag_ms, 3),
        "max_ratio": round(max(ratio.values()), 3),
    }))


if __name__ == "__main__":
    main()
