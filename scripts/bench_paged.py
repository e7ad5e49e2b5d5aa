"""Dense vs paged KV cache at the same KV bytes, under the long-tailed lengths of
configs/sampler_bound.py.

    PYTHONPATH=. python scripts/bench_paged.py              # 512 sequences
    PYTHONPATH=. python scripts/bench_paged.py --quick      # 128 sequences, for a smoke run

Workload: `--sequences` requests whose answer length L is drawn from the sampler-bound task's
length distribution (`task.median_length` / `p99_length` / `max_length` of
configs/sampler_bound.py: lognormal, median 12, p99 96, cap 126): a prompt of L + 1 random
tokens (the letters and '='), exactly L + 1 new tokens (the answer and EOS; no stop token,
so both layouts generate the same lengths), greedy, a tiny model. All are submitted at once.

Both engines get the same KV bytes: the dense engine's cache of `--dense-slots` x
`max_seq_len` (256) tokens; the paged engine a pool of the same number of tokens
(`kv_budget_tokens`) in pages of `--page-size`, with `--paged-slots` decode rows (slots are
only batch rows there: what limits concurrency is the pool). Both are warmed up first
(compiles excluded).

Figures: active sequences per decode step (mean and decode-step-weighted p50 of the chunk
averages `stats()` reports after every `step()`, over the whole run and over the chunks that
ran while samples were queued, i.e. the steady state of a sampler that is kept fed, before
the final tail drains; hardware independent), tokens/s (wall
clock, measured side by side in one process), preemptions per 1,000 sequences, and whether
the paged engine's tokens equal the dense engine's. Prints one JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import sampler_bound  # noqa: E402
from pipelinerl_jax.models import Decoder, tiny_config  # noqa: E402
from pipelinerl_jax.rollout import engine_memory  # noqa: E402
from pipelinerl_jax.rollout.jax_engine import JaxEngine  # noqa: E402
from pipelinerl_jax.tasks.synthetic import SyntheticStringTask  # noqa: E402
from pipelinerl_jax.types import GenerationRequest, SamplingParams  # noqa: E402

MAX_SEQ_LEN = 256  # the sampler-bound config's context: 128 prompt + 127 answer tokens


def workload(n: int, seed: int, vocab: int):
    t = sampler_bound.get_config().task
    task = SyntheticStringTask("reverse", t.median_length, t.p99_length, t.min_length,
                               t.max_length)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        length = task.sample_length(rng)
        prompt = rng.integers(1, vocab, length + 1).astype(np.int32)
        reqs.append(GenerationRequest(f"s{i}", prompt, SamplingParams(
            max_new_tokens=length + 1, temperature=0.0, seed=i)))
    return reqs


def weighted_median(values, weights):
    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights)[order]
    return float(v[np.searchsorted(np.cumsum(w), 0.5 * w.sum())])


def run(model, config: dict, reqs):
    eng = JaxEngine(model, config)
    eng.warmup()
    eng.stats()  # opens a fresh window
    eng.submit_batch(reqs)
    chunk_active, chunk_steps, chunk_queued, done = [], [], [], []
    t0 = time.perf_counter()
    while len(done) < len(reqs):
        eng.step()
        done += eng.get_completions()
        s = eng.stats()
        if s["window_decode_steps"]:
            chunk_active.append(s["slot_occupancy"] * s["num_slots"])
            chunk_steps.append(s["window_decode_steps"])
            # a chunk that ran while samples waited: the engine was as full as it could be
            chunk_queued.append(s["occupancy_while_queued"] > 0)
    wall = time.perf_counter() - t0
    s = eng.stats()
    eng.close()
    tokens = sum(len(c.token_ids) for c in done)
    steps, active = np.asarray(chunk_steps, float), np.asarray(chunk_active)
    q = np.asarray(chunk_queued, bool)
    out = {
        "slots": config["max_slots"],
        "mean_active": float(np.dot(active, steps) / steps.sum()),
        "p50_active": weighted_median(active, steps),
        "mean_active_while_queued": float(np.dot(active[q], steps[q]) / steps[q].sum()),
        "p50_active_while_queued": weighted_median(active[q], steps[q]),
        "decode_steps": int(s["decode_steps"]),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": tokens / wall,
        "prefill_calls": int(s["prefill_calls"]),
        "preemptions": int(s["preemptions"]),
        "preemptions_per_1000": 1000.0 * s["preemptions"] / len(reqs),
    }
    return out, {c.request_id: c.token_ids for c in done}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--dense-slots", type=int, default=16)
    ap.add_argument("--paged-slots", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="16 sequences (more than the paged rows: some chunks run while "
                         "samples wait), 2 dense slots / 8 paged rows, prefill batches 1-2, "
                         "one bucket each (device_check --cpu)")
    args = ap.parse_args()
    if args.smoke:
        args.sequences, args.dense_slots, args.paged_slots = 16, 2, 8
    smoke = dict(max_prefill_batch=2, prefill_buckets=(MAX_SEQ_LEN,),
                 cache_buckets=(MAX_SEQ_LEN,)) if args.smoke else {}
    n = 128 if args.quick else args.sequences

    cfg = tiny_config()
    model = Decoder(cfg, nnx.Rngs(0))
    reqs = workload(n, args.seed, cfg.vocab_size)
    budget_tokens = args.dense_slots * MAX_SEQ_LEN
    kv_bytes = engine_memory.kv_cache_bytes(cfg, args.dense_slots, MAX_SEQ_LEN, "float32")
    common = {**dict(max_seq_len=MAX_SEQ_LEN, max_prefill_batch=16, steps_per_sync=16), **smoke}
    dense, dense_tokens = run(model, {**common, "max_slots": args.dense_slots}, reqs)
    paged, paged_tokens = run(model, {**common, "max_slots": args.paged_slots,
                                      "kv_layout": "paged", "page_size": args.page_size,
                                      "kv_budget_tokens": budget_tokens}, reqs)
    same = sum(np.array_equal(dense_tokens[k], paged_tokens[k]) for k in dense_tokens)
    lengths = [len(r.prompt_ids) + r.params.max_new_tokens for r in reqs]
    result = {
        "bench": "paged_kv",
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, load {os.getloadavg()[0]:.1f}",
        "sequences": n,
        "sequence_length": {"mean": float(np.mean(lengths)), "p50": float(np.median(lengths)),
                            "p99": float(np.percentile(lengths, 99)), "max": max(lengths)},
        "kv_bytes": kv_bytes,
        "kv_tokens": budget_tokens,
        "page_size": args.page_size,
        "dense": dense,
        "paged": paged,
        "active_ratio_vs_dense": paged["mean_active"] / dense["mean_active"],
        "p50_active_ratio_vs_dense": paged["p50_active"] / dense["p50_active"],
        "active_while_queued_ratio_vs_dense": (paged["mean_active_while_queued"]
                                               / dense["mean_active_while_queued"]),
        "tokens_per_s_ratio_vs_dense": paged["tokens_per_s"] / dense["tokens_per_s"],
        "decode_steps_ratio_vs_dense": paged["decode_steps"] / dense["decode_steps"],
        "greedy_tokens_identical": same / n,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
