"""Cost of VCPO's off-policy optimal baseline (`loss.baseline='opob'`) in the learner's train
step, against VCPO without it (`'none'`), on the tiny test model on CPU.

The baseline adds, per sequence, one forward and one backward of the packed row that holds
it (through its vjp), so the ratio stays near the cost of one more forward and backward.
Every configuration takes turns in each round (load on a shared machine hits them alike);
the median wall time and process CPU time of one jitted step, after a warmup, are reported.

    PYTHONPATH=. python scripts/bench_vcpo_baseline.py [--seqs 16 --micro 1 --repeats 10]

Prints a table, then ONE final JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from pipelinerl_jax import sharding
from pipelinerl_jax.learner import batching, loop, train_step as ts
from pipelinerl_jax.models.factory import create_model
from tests.learner.step_testlib import MODEL, _rollouts
from tests.learner.test_staleness_clip_step import _cfg


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rollouts = _rollouts(list(rng.integers(40, 100, args.seqs)), seed=1)
    arrays = batching.pack(rollouts, 2, num_seqs=args.seqs, chunks=args.micro, pack_len=128,
                           completion_len=100).arrays
    mesh = sharding.make_mesh((1, 1, 1))
    runs = {}
    for form in ("none", "opob"):
        cfg = _cfg("vcpo", 1, baseline=form)
        cfg.learner.micro_batches = args.micro
        model = create_model(MODEL, mesh, seed=3)
        optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
        state = ts.init_state(model, optimizer, mesh)
        step = loop.make_step(cfg, model, optimizer, mesh, state)
        batch = ts.place_batch(arrays, mesh)
        for _ in range(2):  # compile, warm
            state, m = step(state, batch)
            jax.block_until_ready(m)
        runs[form] = [step, state, batch, [], []]
    for _ in range(args.repeats):
        for form, run in runs.items():
            step, state, batch, wall, cpu = run
            t, c = time.perf_counter(), time.process_time()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            run[1] = state
    out = {f: {"wall_ms": 1e3 * float(np.median(r[3])), "cpu_ms": 1e3 * float(np.median(r[4]))}
           for f, r in runs.items()}
    for f, v in out.items():
        print(f"{f:6s} wall {v['wall_ms']:9.1f} ms   cpu {v['cpu_ms']:9.1f} ms")
    ratio = {k: out["opob"][k] / out["none"][k] for k in ("wall_ms", "cpu_ms")}
    print(f"opob/none: wall {ratio['wall_ms']:.2f}x  cpu {ratio['cpu_ms']:.2f}x "
          f"({args.seqs} sequences, {args.micro} micro-batch(es), tiny model)")
    print(json.dumps({"seqs": args.seqs, "micro_batches": args.micro, **out,
                      "ratio_wall": ratio["wall_ms"], "ratio_cpu": ratio["cpu_ms"]}))


if __name__ == "__main__":
    main()
