"""Step costs from the compiler: the simulator's decode and train times from a compile check.

`experiments/compile_check.py` compiles one engine's decode step at two attention lengths
(every slot running) and the learner's train step for a TPU topology, and its final JSON
carries, per chip, their FLOPs and bytes from XLA's cost analysis (`estimates.sim_costs`).
With `costs_from` set to that JSON the simulator replaces its datasheet roofline
(`latency.DecodeLatency.roofline`, `TrainTime.roofline`) by these:

    decode, B rows at S1 < S2 positions (C = B·S context tokens):
        bytes(C) = bytes_0 + β·C,  flops(C) = flops_0 + φ·C     (two points, exact)
        mem_fixed_s = bytes_0 / (bw·mbu)      mem_per_ctx_s = β / (bw·mbu)
        cmp_per_seq_s = flops_0 / B / (peak·mfu)   cmp_per_ctx_s = φ / (peak·mfu)
    train: per_token_device_s = roofline_s / tokens · learner chips / train_mfu

bw and peak are one chip's (the compiled program is one chip's share of the SPMD step, so
no division by the engine's chips); `mbu`, `mfu`, `train_mfu` are the config's hardware
fractions, as for the datasheet model. The compiler's costs replace the parameter counts and
FLOP rules of thumb, not a measurement (docs/tpu.md).
"""
from __future__ import annotations

import json

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim.hardware import Accelerator
from pipelinerl_jax.sim.latency import DecodeLatency, TrainTime

KEY = "costs_from"


def read_costs(path: str) -> dict:
    """`estimates.sim_costs` of a compile check's JSON (the file written by `--out`, or a log
    whose last line is that object); `ConfigError` naming `costs_from` otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        check = json.loads(lines[-1])
        costs = check["estimates"]["sim_costs"]
    except (OSError, IndexError, KeyError, ValueError) as e:
        raise ConfigError(KEY, f"cannot read a compile check's JSON from {path!r}: "
                               f"{type(e).__name__}: {e}") from None
    if check.get("plan") == "quick":  # its train step's bytes are another plan's (docs/tpu.md)
        raise ConfigError(KEY, f"{path} is a quick compile check (--fast): its train-step "
                               f"cost is rough (11-48% under the full plan's on the 7B "
                               f"recipes); give the simulator a full check (without --fast)")
    lengths = {d["cache_len"] for d in costs.get("decode", [])}
    if len(lengths) < 2 or "train_per_token_s" not in costs:
        raise ConfigError(KEY, f"{path}: needs the decode step at two attention lengths and "
                               f"the train step (run compile_check with both roles)")
    return costs


def _line(points, key):
    """(intercept, slope) of `key` against context tokens through the extreme two points."""
    lo, hi = points[0], points[-1]
    c_lo, c_hi = lo["rows"] * lo["cache_len"], hi["rows"] * hi["cache_len"]
    slope = max((hi[key] - lo[key]) / (c_hi - c_lo), 0.0)
    return max(lo[key] - slope * c_lo, 0.0), slope


def decode_latency(costs: dict, acc: Accelerator, sharpness: float = 4.0,
                   overhead_s: float = 0.0) -> DecodeLatency:
    points = sorted(costs["decode"], key=lambda d: d["cache_len"])
    rows = points[0]["rows"]
    bytes_0, beta = _line(points, "bytes_accessed")
    flops_0, phi = _line(points, "flops")
    bw, flops = acc.hbm_bw * acc.mbu, acc.peak_flops * acc.mfu
    return DecodeLatency(mem_fixed_s=bytes_0 / bw, mem_per_ctx_s=beta / bw,
                         cmp_per_seq_s=flops_0 / rows / flops, cmp_per_ctx_s=phi / flops,
                         sharpness=sharpness, overhead_s=overhead_s)


def train_time(costs: dict, acc: Accelerator, fixed_s: float = 0.0) -> TrainTime:
    per_device = costs["train_per_token_s"] * costs["learner_chips"] / acc.train_mfu
    return TrainTime(fixed_s, per_device)
