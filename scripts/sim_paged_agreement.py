"""Does the simulator's KV-limited batch model agree with the paged engine? Active sequences
per decode step, measured on the real paged JaxEngine and predicted by the simulator, at
several KV budgets, under the long-tailed lengths of configs/sampler_bound.py.

    PYTHONPATH=. python scripts/sim_paged_agreement.py            # 512 sequences, 2 budgets
    PYTHONPATH=. python scripts/sim_paged_agreement.py --quick    # 64 sequences, smoke run

Workload: `scripts/bench_paged.py`'s `sampler_bound_workload()` (answer length L from the
sampler-bound task, prompt L + 1 tokens, exactly L + 1 new tokens, greedy, all queued at once), on its
engine settings (max_seq_len 256, 16 decode steps per chunk, pages of 16, 128 decode rows),
with a page pool of each `--budgets` tokens. Coarser prefill / cache buckets than the bench
keep compiles few; buckets change no admission, chunk or page decision.

Per budget, four predictions against the engine's measurement (chunk means of `stats()`
after every `step()`, laid out over decode steps):
  paged model, same draws      `sim.paged.ChunkedEngine` on the very requests the engine ran
                               (the admission rules, checked exactly);
  paged model, fresh draws     the same on requests drawn afresh from the distribution
                               (`--sim-seed`): what the simulator predicts from the
                               distribution alone;
  fixed slots, 'paged'/'expected'  `sim.engines.EnginePool` (the pipeline simulator's pool) with
                               the slots `rollout.kv_budget='paged'` / `'expected'` give for
                               this budget and distribution, unit step time, fresh draws.
Figures: mean and p50 active sequences (decode-step weighted chunk means; also while
sequences were queued, and `steady`: while queued after the opening `--skip` steps, when
every cache starts fresh and short), decode steps, preemptions, the ratio of each
prediction to the engine, and a normalised error: the mean absolute per-step difference of
the two curves over the engine's mean. One PNG (`--out`), one JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipelinerl_jax import compile_cache  # noqa: E402

compile_cache.enable()
import bench_paged  # noqa: E402
from flax import nnx  # noqa: E402

from pipelinerl_jax.models import Decoder, tiny_config  # noqa: E402
from pipelinerl_jax.rollout.jax_engine import JaxEngine  # noqa: E402
from pipelinerl_jax.sim.engines import EnginePool  # noqa: E402
from pipelinerl_jax.sim.latency import DecodeLatency  # noqa: E402
from pipelinerl_jax.sim.lengths import Empirical  # noqa: E402
from pipelinerl_jax.sim.paged import (ChunkedEngine, ChunkTrace, paged_concurrency,  # noqa: E402
                                      record_engine)

STEPS_PER_SYNC = 16
UNIT_STEP = DecodeLatency(mem_fixed_s=1.0, mem_per_ctx_s=0.0, cmp_per_seq_s=0.0,
                          cmp_per_ctx_s=0.0, sharpness=math.inf)  # one decode step = 1 s


def lengths_of(reqs):
    return (np.array([len(r.prompt_ids) for r in reqs]),
            np.array([r.params.max_new_tokens for r in reqs]))


def engine_trace(model, reqs, budget: int, args) -> ChunkTrace:
    config = dict(max_seq_len=bench_paged.MAX_SEQ_LEN, max_prefill_batch=4,
                  steps_per_sync=STEPS_PER_SYNC, max_slots=args.paged_slots,
                  kv_layout="paged", page_size=args.page_size, kv_budget_tokens=budget,
                  prefill_buckets=(64,), cache_buckets=(128,))
    eng = JaxEngine(model, config, start=False)
    try:
        eng.stats()  # a fresh window
        eng.submit_batch(reqs)
        return record_engine(eng, len(reqs))
    finally:
        eng.close()


def model_trace(prompts, new, budget: int, args) -> ChunkTrace:
    return ChunkedEngine(prompts, new, rule="paged", max_slots=args.paged_slots,
                         max_seq_len=bench_paged.MAX_SEQ_LEN, steps_per_sync=STEPS_PER_SYNC,
                         num_pages=-(-budget // args.page_size), page_size=args.page_size).run()


def slots_for(budget: int, prompts, new, kind: str, args) -> int:
    """`config.slots_per_engine`'s count for this budget, from the lengths (D = new - 1
    decode steps; per-request prompts, since prompt and answer lengths move together here:
    for 'expected' the prompt term is the length-biased E[P·D]/E[D])."""
    steps = np.maximum(new - 1, 1).astype(float)
    if kind == "paged":
        active = paged_concurrency(budget, prompts, steps, page_size=args.page_size,
                                   steps_per_sync=STEPS_PER_SYNC,
                                   refill_threshold=max(1, args.paged_slots // 8),
                                   max_slots=args.paged_slots)
        return max(1, int(active))
    prompt = float(np.dot(prompts, steps) / steps.sum())
    per_seq = prompt + float((steps ** 2).mean()) / (2 * float(steps.mean()))
    return max(1, min(args.paged_slots, int(budget // per_seq)))


def steady(trace: ChunkTrace, skip: int) -> float:
    """Mean active sequences over the chunks that ran queued, after the first `skip` decode
    steps (the opening burst, when every cache is fresh and short, is no steady state)."""
    keep = trace.queued & (np.cumsum(trace.steps) > skip)
    return float(np.dot(trace.active[keep], trace.steps[keep]) / max(trace.steps[keep].sum(), 1))


def pool_curve(slots: int, new, seed: int) -> np.ndarray:
    """Active sequences per decode step of `EnginePool` with `slots` slots draining len(new)
    samples (each runs its decode steps, new - 1; prefill costs no step)."""
    steps = np.maximum(new - 1, 1)
    pool = EnginePool(1, slots, UNIT_STEP, Empirical(steps), prompt_len=1, group_size=1,
                      rng=np.random.default_rng(seed), prefill_tokens_per_sample=0.0)
    pool.set_group_cap(len(new))
    _, t_in, _, _, t_out = pool.advance(math.inf)
    horizon = int(round(t_out.max()))
    delta = np.zeros(horizon + 1)
    np.add.at(delta, np.round(t_in).astype(int), 1)
    np.add.at(delta, np.round(t_out).astype(int), -1)
    return np.cumsum(delta)[:horizon]


def curve_stats(curve: np.ndarray) -> dict:
    return {"mean_active": float(curve.mean()), "p50_active": float(np.median(curve)),
            "decode_steps": int(curve.size)}


def error(pred: np.ndarray, meas: np.ndarray) -> float:
    """Mean |pred - meas| per decode step (the shorter curve padded with zeros) / mean meas."""
    n = max(pred.size, meas.size)
    a, b = np.zeros(n), np.zeros(n)
    a[:pred.size], b[:meas.size] = pred, meas
    return float(np.abs(a - b).mean() / meas.mean())


def compare(pred: dict, meas: dict) -> dict:
    out = dict(pred)
    for k in ("mean_active", "p50_active", "mean_active_while_queued", "mean_active_steady",
              "decode_steps"):
        if k in pred and meas.get(k):  # (no chunk ran queued when every sequence fits)
            out[f"{k}_ratio"] = pred[k] / meas[k]
    return out


def long_run(args) -> dict:
    """The closed forms against the chunk-by-chunk model in a long fed run (model only, no
    engine): 6,000 requests, the steady mean after the first 300 decode steps, at 1k-8k
    token pools, with the bench's decode rows (the refill threshold cuts chunks short) and
    with rows enough that chunks run whole."""
    prompts, new = lengths_of(bench_paged.sampler_bound_workload(6000, 3,
                                                                 tiny_config().vocab_size))
    out = {}
    for rows in (args.paged_slots, 100_000):
        a = argparse.Namespace(**{**vars(args), "paged_slots": rows})
        for budget in (1024, 2048, 4096, 8192):
            t = ChunkedEngine(prompts, new, rule="paged", max_slots=rows,
                              max_seq_len=bench_paged.MAX_SEQ_LEN,
                              steps_per_sync=STEPS_PER_SYNC,
                              num_pages=budget // args.page_size,
                              page_size=args.page_size).run()
            measured = steady(t, 300)
            steps = np.maximum(new - 1, 1).astype(float)
            prompt = float(np.dot(prompts, steps) / steps.sum())
            half_page = prompt + float((steps ** 2).mean()) / (2 * steps.mean()) \
                + STEPS_PER_SYNC + (args.page_size - 1) / 2
            out[f"rows{rows}_pool{budget}"] = {
                "measured": measured, "mean_chunk": float(t.steps.mean()),
                "preemptions": int(t.preempted.sum()),
                "paged_ratio": paged_concurrency(
                    budget, prompts, steps, page_size=args.page_size,
                    steps_per_sync=STEPS_PER_SYNC, refill_threshold=max(1, rows // 8),
                    max_slots=rows) / measured,
                "expected_ratio": min(rows, budget / (half_page - STEPS_PER_SYNC
                                                      - (args.page_size - 1) / 2)) / measured,
                "expected_plus_chunk_ratio": min(rows, budget / half_page) / measured}
    return out


def plot(panels, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.2), squeeze=False)
    for ax, (budget, curves) in zip(axes[0], panels):
        style = {"engine (measured)": dict(color="black", lw=2.4),
                 "paged model, same draws": dict(color="tab:blue", lw=1.2, ls="--"),
                 "paged model, fresh draws": dict(color="tab:cyan", lw=1.4),
                 "fixed slots, kv_budget='paged'": dict(color="tab:orange", lw=1.4),
                 "fixed slots, kv_budget='expected'": dict(color="tab:gray", lw=1.4, ls=":")}
        for name, curve in curves.items():
            ax.plot(np.arange(curve.size), curve, label=name, **style[name])
        ax.set_title(f"KV pool {budget:,} tokens (pages of 16)")
        ax.set_xlabel("decode step")
        ax.set_ylabel("active sequences")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Paged JaxEngine vs simulator: sampler-bound lengths, 16-step chunks")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--skip", type=int, default=64,
                    help="decode steps of opening burst left out of the steady-state mean")
    ap.add_argument("--budgets", default="2048,4096", help="KV pool sizes in tokens")
    ap.add_argument("--paged-slots", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-seed", type=int, default=1)
    ap.add_argument("--out", default="docs/figures/sim/paged_agreement.png")
    args = ap.parse_args()
    n = 64 if args.quick else args.sequences
    budgets = [int(b) for b in ("512,1024" if args.quick else args.budgets).split(",")]

    cfg = tiny_config()
    model = Decoder(cfg, nnx.Rngs(0))
    reqs = bench_paged.sampler_bound_workload(n, args.seed, cfg.vocab_size)
    prompts, new = lengths_of(reqs)
    fresh_p, fresh_n = lengths_of(bench_paged.sampler_bound_workload(n, args.sim_seed,
                                                                     cfg.vocab_size))

    results, panels, t0 = {}, [], time.perf_counter()
    for budget in budgets:
        eng = engine_trace(model, reqs, budget, args)
        same = model_trace(prompts, new, budget, args)
        fresh = model_trace(fresh_p, fresh_n, budget, args)
        meas, meas_curve = eng.summary(), eng.per_step()
        meas["mean_active_steady"] = steady(eng, args.skip)
        slots = {k: slots_for(budget, fresh_p, fresh_n, k, args) for k in ("paged", "expected")}
        pools = {k: pool_curve(s, fresh_n, args.sim_seed) for k, s in slots.items()}
        curves = {"engine (measured)": meas_curve,
                  "paged model, same draws": same.per_step(),
                  "paged model, fresh draws": fresh.per_step(),
                  "fixed slots, kv_budget='paged'": pools["paged"],
                  "fixed slots, kv_budget='expected'": pools["expected"]}
        panels.append((budget, curves))
        results[str(budget)] = {
            "engine": meas,
            "paged_model_same_draws": {**compare({**same.summary(), "mean_active_steady":
                                                  steady(same, args.skip)}, meas),
                                       "error": error(same.per_step(), meas_curve),
                                       "trace_identical": bool(
                                           np.array_equal(same.steps, eng.steps)
                                           and np.allclose(same.active, eng.active)
                                           and np.array_equal(same.admitted, eng.admitted)
                                           and np.array_equal(same.preempted, eng.preempted))},
            "paged_model_fresh_draws": {**compare({**fresh.summary(), "mean_active_steady":
                                                   steady(fresh, args.skip)}, meas),
                                        "error": error(fresh.per_step(), meas_curve)},
            **{f"fixed_slots_{k}": {"slots": slots[k],
                                    "slots_ratio_vs_engine_steady":
                                        slots[k] / max(meas["mean_active_steady"], 1e-9),
                                    **compare(curve_stats(pools[k]), meas),
                                    "error": error(pools[k], meas_curve)}
               for k in ("paged", "expected")},
        }
    plot(panels, args.out)
    print(json.dumps({
        "bench": "sim_paged_agreement",
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, load {os.getloadavg()[0]:.1f}",
        "sequences": n, "page_size": args.page_size, "steps_per_sync": STEPS_PER_SYNC,
        "paged_slots": args.paged_slots, "wall_s": round(time.perf_counter() - t0, 1),
        "figure": args.out, "budgets": results, "long_run_closed_form": long_run(args)}))


if __name__ == "__main__":
    main()
