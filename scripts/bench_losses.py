"""Cost of each off-policy correction relative to the plain policy gradient.

Per loss: the median wall time of one jitted forward + backward (gradient w.r.t. logp, every
diagnostic included) over a [B, T] batch, after warmup, and its ratio to `reinforce` (and its
process CPU time against `ppo`'s); the same
built with `diagnostics=False`; and the loss-independent diagnostics alone. All functions take
turns in every round, so load drifting on a shared machine hits them alike; the ratio of
process CPU times is reported too (steadier when other processes compete for the cores).
Inputs are staleness-like: a proximal policy, lags 0..12, ragged rows, per-token entropy, and
log-ratios wide enough that m2po has to drop tokens.

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


def interleaved_median_ms(fns: dict, args: dict, repeats: int) -> tuple[dict, dict]:
    """Median wall time and median process CPU time (ms) of each function. The functions take
    turns in every round so that a shared machine's load drifts over all of them alike; CPU
    time is the steadier figure when other processes compete for the cores."""
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))  # compile
        jax.block_until_ready(fn(*args[name]))  # warm caches
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args[name]))
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    median = lambda t: {k: float(np.median(v) * 1e3) for k, v in t.items()}  # noqa: E731
    return median(wall), median(cpu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    inputs = make_inputs(args.batch, args.seq)
    fns, fn_args = {}, {}
    for name in LOSSES:
        for diagnostics in (True, False):
            loss_fn = get_loss(name, diagnostics=diagnostics)
            key = name if diagnostics else f"{name}/no_diagnostics"
            fns[key] = jax.jit(jax.value_and_grad(
                lambda logp, rest, f=loss_fn: f(rest._replace(logp=logp)), has_aux=True))
            fn_args[key] = (inputs.logp, inputs)
    fns["diagnostics"] = jax.jit(off_policy_diagnostics)
    fn_args["diagnostics"] = (inputs,)
    wall, cpu = interleaved_median_ms(fns, fn_args, args.repeats)
    ms = {name: wall[name] for name in LOSSES}
    bare = {name: wall[f"{name}/no_diagnostics"] for name in LOSSES}
    ratio = {name: ms[name] / ms["reinforce"] for name in LOSSES}
    bare_ratio = {name: bare[name] / bare["reinforce"] for name in LOSSES}
    cpu_ratio = {name: cpu[name] / cpu["reinforce"] for name in LOSSES}
    cpu_ms = {name: cpu[name] for name in LOSSES}
    cpu_to_ppo = {name: cpu[name] / cpu["ppo"] for name in LOSSES}

    print(f"{'loss':16s} {'ms':>8s} {'x reinforce':>12s} {'x (cpu time)':>13s} "
          f"{'cpu ms':>8s} {'x ppo (cpu)':>12s} {'ms no diag':>11s} {'x':>6s}")
    for name in LOSSES:
        print(f"{name:16s} {ms[name]:8.2f} {ratio[name]:12.2f} {cpu_ratio[name]:13.2f} "
              f"{cpu_ms[name]:8.2f} {cpu_to_ppo[name]:12.2f} {bare[name]:11.2f} "
              f"{bare_ratio[name]:6.2f}")
    print(f"{'(diagnostics)':16s} {wall['diagnostics']:8.2f}")
    print(json.dumps({
        "bench": "losses", "shape": [args.batch, args.seq], "repeats": args.repeats,
        "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
        "cpu": platform.processor() or platform.machine(),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "ratio_to_reinforce": {k: round(v, 3) for k, v in ratio.items()},
        "ratio_to_reinforce_cpu_time": {k: round(v, 3) for k, v in cpu_ratio.items()},
        "cpu_ms": {k: round(v, 3) for k, v in cpu_ms.items()},
        "ratio_to_ppo_cpu_time": {k: round(v, 3) for k, v in cpu_to_ppo.items()},
        "ms_without_diagnostics": {k: round(v, 3) for k, v in bare.items()},
        "ratio_without_diagnostics": {k: round(v, 3) for k, v in bare_ratio.items()},
        "diagnostics_ms": round(wall["diagnostics"], 3),
        "max_ratio": round(max(ratio.values()), 3),
    }))


if __name__ == "__main__":
    main()
