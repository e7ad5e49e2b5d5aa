"""A-3PO's saving: the learner's train step with the proximal policy recomputed (decoupled PPO,
one extra no-grad forward pass over the batch before the first of several minibatch updates)
against A-3PO's interpolated proximal policy (no extra pass), at Qwen2.5-0.5B's shape.

Both steps are the learner's real jitted step (`learner/train_step.py`) on one device, the same
packed batch (every token at lag `--lag`), `--minibatches` updates per batch; they are timed
interleaved (recompute, a3po, recompute, ...) on one train state so that load drifting on a
shared machine hits both alike; the median wall and process-CPU seconds per step, and the
saving, are reported. The model is random with the 0.5B config (nothing downloaded).

    PYTHONPATH=. python scripts/bench_a3po.py [--seqs 4 --prompt 16 --completion 48
                                               --minibatches 2 --rounds 3] [--smoke]

Prints one final JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.losses import get_loss
from pipelinerl_jax.models import config_qwen2_5_0_5b, tiny_config
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.models.factory import create_model
from scripts.bench_real_size import synthetic_rollouts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--completion", type=int, default=48)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--lag", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the tiny model, a few seconds")
    a = p.parse_args()

    cfg = tiny_config("qwen2") if a.smoke else config_qwen2_5_0_5b()
    mesh = sharding.make_mesh((1, 1, 1))
    model = create_model(cfg, mesh, seed=0)
    optimizer, _ = ts.make_optimizer(base_config().learner.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    rollouts = [dataclasses.replace(r, version=np.zeros_like(r.version))
                for r in synthetic_rollouts(a.seqs, a.prompt, a.completion, cfg.vocab_size)]
    packed = batching.pack(rollouts, a.lag, num_seqs=a.seqs, chunks=a.minibatches,
                           pack_len=a.prompt + a.completion, completion_len=a.completion)
    batch = ts.place_batch(packed.arrays, mesh)
    arms = {"recompute": ("decoupled_ppo", True), "a3po": ("a3po", False)}
    steps = {}
    for arm, (loss, use_proximal) in arms.items():
        step = ts.make_train_step(nnx.graphdef(model), optimizer, get_loss(loss), mesh=mesh,
                                  state_sharding=ts.state_shardings(state),
                                  minibatches=a.minibatches, use_proximal=use_proximal)
        t = time.perf_counter()
        steps[arm] = step.jitted.lower(state, batch, step.hparams).compile(), step.hparams
        print(f"{arm}: compiled in {time.perf_counter() - t:.1f} s", flush=True)
    wall = {arm: [] for arm in arms}
    cpu = {arm: [] for arm in arms}
    for r in range(a.rounds + 1):  # round 0 warms up
        for arm, (compiled, hp) in steps.items():
            t, c = time.perf_counter(), time.process_time()
            state, metrics = compiled(state, batch, hp)
            jax.block_until_ready(state)
            if r:
                wall[arm].append(time.perf_counter() - t)
                cpu[arm].append(time.process_time() - c)
            if not np.isfinite(float(metrics["loss"])):
                raise FloatingPointError(f"{arm}: non-finite loss")
            print(f"round {r} {arm}: {time.perf_counter() - t:.2f} s", flush=True)
    med = {arm: float(np.median(v)) for arm, v in wall.items()}
    med_cpu = {arm: float(np.median(v)) for arm, v in cpu.items()}
    print(json.dumps({
        "bench": "a3po", "model": "tiny" if a.smoke else "qwen2.5-0.5b-shape",
        "params": cfg.num_params, "tokens": a.seqs * (a.prompt + a.completion),
        "trained_tokens": packed.num_tokens, "minibatches": a.minibatches, "rounds": a.rounds,
        "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
        "cpu": platform.processor() or platform.machine(),
        "step_s": {k: round(v, 3) for k, v in med.items()},
        "step_cpu_s": {k: round(v, 3) for k, v in med_cpu.items()},
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in wall.items()},
        "saved_s": round(med["recompute"] - med["a3po"], 3),
        "saved_fraction": round(1 - med["a3po"] / med["recompute"], 3),
        "saved_fraction_cpu": round(1 - med_cpu["a3po"] / med_cpu["recompute"], 3),
    }), flush=True)


if __name__ == "__main__":
    main()
