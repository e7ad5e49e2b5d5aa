"""Dense vs paged KV cache at the same KV bytes: under the long-tailed lengths of
configs/sampler_bound.py, under the talk's heavier tail, and with GRPO groups sharing their
prompt.

    PYTHONPATH=. python scripts/bench_paged.py              # 512 sequences per scenario
    PYTHONPATH=. python scripts/bench_paged.py --quick      # 128, for a smoke run

Scenarios (each run by a dense and a paged engine, side by side in one process):

* `sampler_bound`: `--sequences` requests whose answer length L is drawn from the
  sampler-bound task's length distribution (`task.median_length` / `p99_length` /
  `max_length` of configs/sampler_bound.py: lognormal, median 12, p99 96, cap 126): a prompt
  of L + 1 random tokens (the letters and '='), exactly L + 1 new tokens (the answer and EOS;
  no stop token, so both layouts generate the same lengths), greedy.
* `talk_tail`: the talk's shape, "99% of samples done in ~40 s, the last 1% ~80 s more".
  With a sampler decoding every running sequence at one rate, a sample's wall time is
  proportional to its length, so seconds map to tokens by one factor: the p99 answer length
  stands for 40 s and the tail runs to 3x it (40 + 80 s). Answers: 99% lognormal (median 25
  tokens, p99 76 ~ 40 s, clipped there), the last 1% uniform in (76, 228] (~40-120 s);
  prompts 8-24 random tokens; exactly that many new tokens, greedy.
* `groups_n8`, `groups_n16`: GRPO groups, `--sequences / n` requests of `n` samples each
  (sampler-bound prompt and answer lengths, sampled at temperature 1 so the samples of a
  group differ). Figure: prompt prefills per group (`stats()['prompt_prefills']` / groups;
  the dense engine prefills every sample's prompt, n per group; the paged one shares the
  prompt's pages: goal 1.0).
* `multiturn`: multi-turn episodes as `envs/runner.py` runs them (each turn a new request
  whose prompt is the whole history: previous prompt + completion + 8 environment tokens),
  `--episodes` episodes (32; 16 with --quick) of `--turns` turns, a first prompt of 16-32 random
  tokens, answers of sampler-bound lengths capped at 40, greedy; every episode's turn k is
  submitted when turn k - 1 of all of them has finished. Run by the paged engine with
  `prefix_cache` on and off (same pool) and the dense engine. Figure: prefill tokens per
  episode with vs without reuse (`multiturn_prefill_ratio`, hardware independent; turn k
  maps the full pages turn k - 1 wrote, so only the new tokens and the last partial page
  are prefilled, unless eviction took the pages), and tokens identical across the three.

Both engines get the same KV bytes: the dense engine's cache of `--dense-slots` x
`max_seq_len` (256) tokens; the paged engine a pool of the same number of tokens
(`kv_budget_tokens`) in pages of `--page-size`, with `--paged-slots` decode rows (slots are
only batch rows there: what limits concurrency is the pool). Tiny model, all requests
submitted at once, both engines warmed up first (compiles excluded).

Figures: active sequences per decode step (mean and decode-step-weighted p50 of the chunk
averages `stats()` reports after every `step()`, over the whole run and over the chunks that
ran while samples were queued, i.e. the steady state of a sampler that is kept fed, before
the final tail drains; hardware independent), tokens/s (wall clock, side by side in one
process), prompt prefills per group, preemptions per 1,000 sequences, and whether the paged
engine's tokens equal the dense engine's. Prints one JSON line at the end: the
sampler-bound ratios at the top level (`active_ratio_vs_dense`,
`tokens_per_s_ratio_vs_dense`, ...), `prefills_per_group` (n = 8, paged),
`multiturn_prefill_ratio`, and every scenario in full. Progress lines (timestamped: each
engine warmed up, each run done) go to stderr. The tiny model's random weights are drawn on
the host (`models.random_checkpoint.random_params`, NumPy), never initialised on the device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import sampler_bound  # noqa: E402
from pipelinerl_jax.models import decoder_from_flat, tiny_config  # noqa: E402
from pipelinerl_jax.models.random_checkpoint import random_params  # noqa: E402
from pipelinerl_jax.rollout import engine_memory  # noqa: E402
from pipelinerl_jax.rollout.jax_engine import JaxEngine  # noqa: E402
from pipelinerl_jax.tasks.synthetic import SyntheticStringTask  # noqa: E402
from pipelinerl_jax.sim.paged import weighted_median  # noqa: E402
from pipelinerl_jax.records import GenerationRequest, SamplingParams  # noqa: E402
from scripts.bench_progress import progress  # noqa: E402

MAX_SEQ_LEN = 256  # the sampler-bound config's context: 128 prompt + 127 answer tokens
# the talk-shaped tail (module docstring): body median / p99 (~40 s) in tokens, tail to 3x
TALK_MEDIAN, TALK_P99, TALK_TAIL = 25, 76, 3.0


def sampler_bound_workload(n: int, seed: int, vocab: int, group: int = 1):
    """`n` sequences: `n / group` requests of `group` samples (sampled when group > 1). Each
    request draws its answer length L from configs/sampler_bound.py's distribution, then a
    prompt of L + 1 tokens, in that order (so group = 1 gives the first slice's workload:
    the same requests for the same seed, and BENCHMARKS.md's figures stay reproducible)."""
    t = sampler_bound.get_config().task
    task = SyntheticStringTask("reverse", t.median_length, t.p99_length, t.min_length,
                               t.max_length)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n // group):
        length = task.sample_length(rng)
        prompt = rng.integers(1, vocab, length + 1).astype(np.int32)
        sampling = dict(temperature=1.0) if group > 1 else dict(temperature=0.0)
        reqs.append(GenerationRequest(f"s{i}", prompt, SamplingParams(
            max_new_tokens=length + 1, n=group, seed=i, **sampling)))
    return reqs


def talk_lengths(n: int, rng) -> np.ndarray:
    """Answer lengths shaped like the talk's tail: 99% lognormal with the given median and
    p99 (clipped at the p99), the last 1% uniform in (p99, 3 x p99] (module docstring)."""
    sigma = np.log(TALK_P99 / TALK_MEDIAN) / 2.326  # z of the 99th percentile
    body = np.clip(np.round(TALK_MEDIAN * np.exp(sigma * rng.standard_normal(n))), 1, TALK_P99)
    tail = rng.choice(n, max(1, round(0.01 * n)), replace=False)
    body[tail] = rng.integers(TALK_P99 + 1, int(TALK_TAIL * TALK_P99) + 1, len(tail))
    return body.astype(int)


def talk_workload(n: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    reqs = []
    for i, length in enumerate(talk_lengths(n, rng)):
        prompt = rng.integers(1, vocab, int(rng.integers(8, 25))).astype(np.int32)
        reqs.append(GenerationRequest(f"t{i}", prompt, SamplingParams(
            max_new_tokens=int(length), temperature=0.0, seed=i)))
    return reqs


def multiturn_workload(episodes: int, turns: int, seed: int, vocab: int):
    """Per episode: its first prompt, and per turn its answer length and the environment's
    8 tokens that follow the answer (module docstring)."""
    t = sampler_bound.get_config().task
    task = SyntheticStringTask("reverse", t.median_length, t.p99_length, t.min_length,
                               t.max_length)
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab, int(rng.integers(16, 33))).astype(np.int32),
             [(min(task.sample_length(rng), 40), rng.integers(1, vocab, 8).astype(np.int32))
              for _ in range(turns)]) for _ in range(episodes)]


def run_multiturn(model, config: dict, episodes, label: str = "multiturn"):
    """Runs the episodes turn by turn on one engine; returns its figures and every turn's
    tokens."""
    t = time.perf_counter()
    eng = JaxEngine(model, config)
    eng.warmup()
    progress(f"{label}: engine built and warmed up in {time.perf_counter() - t:.1f} s")
    history = [first for first, _ in episodes]
    tokens, t0 = {}, time.perf_counter()
    for k in range(len(episodes[0][1])):
        eng.submit_batch([GenerationRequest(f"e{e}/t{k}", history[e], SamplingParams(
            max_new_tokens=turns[k][0], temperature=0.0, seed=e))
            for e, (_, turns) in enumerate(episodes)])
        done = []
        while len(done) < len(episodes):
            eng.step()
            done += eng.get_completions()
        for c in done:
            e = int(c.request_id[1:c.request_id.index("/")])
            tokens[c.request_id] = c.token_ids
            history[e] = np.concatenate([history[e], c.token_ids, episodes[e][1][k][1]])
    wall = time.perf_counter() - t0
    s = eng.stats()
    eng.close()
    progress(f"{label}: {len(episodes)} episodes done in {wall:.1f} s")
    return {"prefill_tokens": int(s["prefill_tokens"]),
            "prefill_tokens_per_episode": s["prefill_tokens"] / len(episodes),
            "prefix_cache_hits": int(s.get("prefix_cache_hits", 0)),
            "reused_tokens": int(s.get("reused_tokens", 0)),
            "prefix_cache_evictions": int(s.get("prefix_cache_evictions", 0)),
            "preemptions": int(s["preemptions"]),
            "generated_tokens": int(s["generated_tokens"]),
            "wall_s": round(wall, 3)}, tokens


def compare_multiturn(model, episodes, args) -> dict:
    """Paged with and without prefix reuse (same pool), and dense, at the same KV bytes."""
    common = {**dict(max_seq_len=MAX_SEQ_LEN, max_prefill_batch=16, steps_per_sync=16),
              **args.engine_overrides}
    paged = {**common, "max_slots": args.paged_slots, "kv_layout": "paged",
             "page_size": args.page_size, "kv_budget_tokens": args.dense_slots * MAX_SEQ_LEN}
    reuse, reuse_tokens = run_multiturn(model, paged, episodes, "multiturn paged reuse")
    plain, plain_tokens = run_multiturn(model, {**paged, "prefix_cache": False}, episodes,
                                        "multiturn paged no-reuse")
    dense, dense_tokens = run_multiturn(model, {**common, "max_slots": args.dense_slots},
                                        episodes, "multiturn dense")
    keys = sorted(dense_tokens)
    return {
        "episodes": len(episodes), "turns": len(episodes[0][1]),
        "reuse": reuse, "no_reuse": plain, "dense": dense,
        "multiturn_prefill_ratio": reuse["prefill_tokens"] / plain["prefill_tokens"],
        "tokens_identical_reuse_vs_no_reuse": float(np.mean(
            [np.array_equal(reuse_tokens[k], plain_tokens[k]) for k in keys])),
        "tokens_identical_reuse_vs_dense": float(np.mean(
            [np.array_equal(reuse_tokens[k], dense_tokens[k]) for k in keys])),
        "wall_ratio_reuse_vs_no_reuse": reuse["wall_s"] / plain["wall_s"],
    }


def run(model, config: dict, reqs, label: str = "run"):
    t = time.perf_counter()
    eng = JaxEngine(model, config)
    eng.warmup()
    progress(f"{label}: engine built and warmed up in {time.perf_counter() - t:.1f} s")
    eng.stats()  # opens a fresh window
    eng.submit_batch(reqs)
    samples = sum(int(r.params.n) for r in reqs)
    chunk_active, chunk_steps, chunk_queued, done = [], [], [], []
    t0 = time.perf_counter()
    while len(done) < samples:
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
    progress(f"{label}: {samples} samples, {tokens} tokens in {wall:.1f} s")
    steps, active = np.asarray(chunk_steps, float), np.asarray(chunk_active)
    q = np.asarray(chunk_queued, bool)
    out = {
        "slots": config["max_slots"],
        "mean_active": float(np.dot(active, steps) / steps.sum()),
        "p50_active": weighted_median(active, steps),
        "mean_active_while_queued": (float(np.dot(active[q], steps[q]) / steps[q].sum())
                                     if q.any() else None),
        "p50_active_while_queued": weighted_median(active[q], steps[q]) if q.any() else None,
        "decode_steps": int(s["decode_steps"]),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": tokens / wall,
        "prefill_calls": int(s["prefill_calls"]),
        "prefill_tokens": int(s["prefill_tokens"]),
        "prompt_prefills": int(s["prompt_prefills"]),
        "prefills_per_group": s["prompt_prefills"] / len(reqs),
        "preemptions": int(s["preemptions"]),
        "preemptions_per_1000": 1000.0 * s["preemptions"] / samples,
    }
    return out, {(c.request_id, c.sample_index): c.token_ids for c in done}


def compare(model, reqs, args, name: str = "scenario") -> dict:
    """One scenario: dense and paged at the same KV bytes."""
    budget_tokens = args.dense_slots * MAX_SEQ_LEN
    common = {**dict(max_seq_len=MAX_SEQ_LEN, max_prefill_batch=16, steps_per_sync=16),
              **args.engine_overrides}
    dense, dense_tokens = run(model, {**common, "max_slots": args.dense_slots}, reqs,
                              f"{name} dense")
    paged, paged_tokens = run(model, {**common, "max_slots": args.paged_slots,
                                      "kv_layout": "paged", "page_size": args.page_size,
                                      "kv_budget_tokens": budget_tokens}, reqs, f"{name} paged")
    same = sum(np.array_equal(dense_tokens[k], paged_tokens[k]) for k in dense_tokens)
    lengths = [len(r.prompt_ids) + r.params.max_new_tokens for r in reqs]
    def ratio(key):  # (None where a figure is undefined: no chunk ran while samples waited)
        return paged[key] / dense[key] if paged[key] is not None and dense[key] else None
    return {
        "requests": len(reqs),
        "samples_per_request": int(reqs[0].params.n),
        "sequence_length": {"mean": float(np.mean(lengths)), "p50": float(np.median(lengths)),
                            "p99": float(np.percentile(lengths, 99)), "max": max(lengths)},
        "dense": dense,
        "paged": paged,
        "active_ratio_vs_dense": ratio("mean_active"),
        "p50_active_ratio_vs_dense": ratio("p50_active"),
        "active_while_queued_ratio_vs_dense": ratio("mean_active_while_queued"),
        "tokens_per_s_ratio_vs_dense": ratio("tokens_per_s"),
        "decode_steps_ratio_vs_dense": ratio("decode_steps"),
        "tokens_identical": same / len(dense_tokens),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--dense-slots", type=int, default=16)
    ap.add_argument("--paged-slots", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--episodes", type=int, default=32, help="multiturn scenario")
    ap.add_argument("--turns", type=int, default=4, help="multiturn scenario")
    ap.add_argument("--only-multiturn", action="store_true",
                    help="run the multiturn scenario alone")
    ap.add_argument("--smoke", action="store_true",
                    help="16 sequences (more than the paged rows: some chunks run while "
                         "samples wait), 2 dense slots / 8 paged rows, prefill batches 1-2, "
                         "one bucket each; the sampler-bound and n = 8 scenarios and 4 "
                         "episodes of 3 turns (device_check --cpu)")
    args = ap.parse_args()
    progress(f"started: args {vars(args)}")
    if args.smoke:
        args.sequences, args.dense_slots, args.paged_slots = 16, 2, 8
        args.episodes, args.turns = 4, 3
    elif args.quick:
        args.episodes = 16
    args.engine_overrides = dict(max_prefill_batch=2, prefill_buckets=(MAX_SEQ_LEN,),
                                 cache_buckets=(MAX_SEQ_LEN,)) if args.smoke else {}
    n = 128 if args.quick else args.sequences

    cfg = tiny_config()
    model = decoder_from_flat(random_params(cfg, seed=0), cfg)  # host arrays, nothing compiled
    v = cfg.vocab_size
    scenarios = {
        "sampler_bound": sampler_bound_workload(n, args.seed, v),
        "talk_tail": talk_workload(n, args.seed, v),
        "groups_n8": sampler_bound_workload(n, args.seed, v, group=8),
        "groups_n16": sampler_bound_workload(n, args.seed, v, group=16),
    }
    if args.smoke:
        scenarios = {k: scenarios[k] for k in ("sampler_bound", "groups_n8")}
    if args.only_multiturn:
        scenarios = {}
    results = {}
    for name, reqs in scenarios.items():
        results[name] = compare(model, reqs, args, name)
        print(name, json.dumps(results[name]), flush=True)
    results["multiturn"] = compare_multiturn(
        model, multiturn_workload(args.episodes, args.turns, args.seed, v), args)
    print("multiturn", json.dumps(results["multiturn"]), flush=True)
    main_ = results.get("sampler_bound", {"paged": {}})
    result = {
        "bench": "paged_kv",
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, load {os.getloadavg()[0]:.1f}",
        "sequences": n,
        "kv_bytes": engine_memory.kv_cache_bytes(cfg, args.dense_slots, MAX_SEQ_LEN,
                                                 "float32"),
        "kv_tokens": args.dense_slots * MAX_SEQ_LEN,
        "page_size": args.page_size,
        "active_ratio_vs_dense": main_.get("active_ratio_vs_dense"),
        "p50_active_ratio_vs_dense": main_.get("p50_active_ratio_vs_dense"),
        "active_while_queued_ratio_vs_dense": main_.get("active_while_queued_ratio_vs_dense"),
        "tokens_per_s_ratio_vs_dense": main_.get("tokens_per_s_ratio_vs_dense"),
        "greedy_tokens_identical": main_.get("tokens_identical"),
        "preemptions_per_1000": main_["paged"].get("preemptions_per_1000"),
        "prefills_per_group": results.get("groups_n8", {}).get("paged", {}).get(
            "prefills_per_group"),
        "prefills_per_group_n16": results.get("groups_n16", {}).get("paged", {}).get(
            "prefills_per_group"),
        "talk_tail_active_ratio_vs_dense": results.get("talk_tail", {}).get(
            "active_ratio_vs_dense"),
        "talk_tail_tokens_per_s_ratio_vs_dense": results.get("talk_tail", {}).get(
            "tokens_per_s_ratio_vs_dense"),
        "multiturn_prefill_ratio": results["multiturn"]["multiturn_prefill_ratio"],
        "multiturn_tokens_identical": min(
            results["multiturn"]["tokens_identical_reuse_vs_no_reuse"],
            results["multiturn"]["tokens_identical_reuse_vs_dense"]),
        "scenarios": results,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
