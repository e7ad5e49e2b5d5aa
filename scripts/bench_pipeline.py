"""Async vs sync on the default task: wall-clock to a target held-out accuracy.

    python scripts/bench_pipeline.py [--steps 120] [--target 0.5] [--max_lags 1,2,4,8]
                                     [--warm_start PATH] [--out runs/bench_pipeline]
                                     [--warmup_steps 20] [--xla_cache OUT/xla_cache]

Trains the default warm start once (or takes `--warm_start`), then runs the real pipeline
(`experiments/train.py`, same processes and the same two cores) in `mode=sync` and in
`mode=async` at each `max_lag`, all from that checkpoint with the same seed and step budget.
Before any timed run, a throwaway `--warmup_steps`-step run (the ablation runner's `warmup`)
fills the XLA compilation cache every run then shares, so no run is charged for compiling:
on a fresh machine the first (sync) run was otherwise charged ~33 s of it (80.2 s cold vs
46.8 s warm for 60 steps, which printed a 3.05x async speedup where the warm one is 1.30x).
The warm-up's time is reported apart (`warmup`), and per run the XLA cache entries it still
had to add (`new_cache_entries`: 0 means nothing it timed was compiling).
Held-out evaluation blocks the learner, so its time is subtracted from the wall-clock
everywhere. Per run it reports: seconds to reach `--target` greedy accuracy (None if never),
final accuracy, steps/s, mean sampler slot occupancy (time-averaged, idle counted empty),
learner idle fraction (time waiting for a batch / training time), learner tokens/s and MFU
against this machine's measured float32 matmul peak. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(workdir, flags, env):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
           "--config=" + os.path.join(ROOT, "configs", "default.py"), f"--workdir={workdir}",
           *flags]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env)


def cache_entries(cache_dir):
    return len(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else 0


def warm_up(warm, steps, out, env):
    """The runner's `warmup` of the first (sync) variant: the same config as its timed run."""
    from configs import default
    from pipelinerl_jax.ablation.runner import warmup
    cfg = default.get_config()
    cfg.warm_start.checkpoint = warm
    cfg.mode, cfg.max_lag = "sync", 0
    return warmup(cfg, os.path.join(out, "warmup"), steps, env)


def summarise(workdir, target, params, peak_gflops):
    from pipelinerl_jax.metrics import eval_on_learner_step, read_metrics
    rows = read_metrics(workdir)  # the learner's rows, the evaluator's records merged in
    blocking = eval_on_learner_step(workdir)  # older runs: evaluation inside wall_time_s
    eval_spent, points = 0.0, []
    for r in rows:
        eval_spent += r.get("eval/time_s", 0.0) if blocking else 0.0
        if "eval/accuracy" in r:
            points.append((r["wall_time_s"] - eval_spent, r["eval/accuracy"]))
    steps = [r for r in rows if r["step"] > 0]
    t0 = points[0][0] if points else 0.0
    reached = next((t - t0 for t, acc in points if acc >= target), None)
    train_s = points[-1][0] - t0 if points else None
    wait = sum(r["learner/wait_time_s"] for r in steps)
    busy = sum(r["learner/step_time_s"] + r["weight_sync/time_s"] for r in steps)
    tokens = sum(r["learner/tokens"] for r in steps)
    step_s = sum(r["learner/step_time_s"] for r in steps[1:])  # first step loads or compiles
    tok_s = sum(r["learner/tokens"] for r in steps[1:]) / max(step_s, 1e-9)
    occ = [r["sampler/occupancy"] for r in steps if "sampler/occupancy" in r]
    return {
        "time_to_target_s": None if reached is None else round(reached, 1),
        "accuracy_first": points[0][1] if points else None,
        "accuracy_final": points[-1][1] if points else None,
        "train_wall_s": None if train_s is None else round(train_s, 1),
        "steps": len(steps),
        "sampler_occupancy": round(sum(occ) / max(len(occ), 1), 3),
        "learner_idle_fraction": round(wait / max(wait + busy, 1e-9), 3),
        "learner_tokens_per_s": round(tok_s, 1),
        "learner_trained_tokens": tokens,
        # 6 FLOPs per parameter per trained token (forward + backward), completion tokens only
        "learner_mfu": round(6 * params * tok_s / 1e9 / peak_gflops, 4),
        "lag_mean": round(sum(r["lag/mean"] for r in steps) / max(len(steps), 1), 2),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--max_lags", default="1,2,4,8")
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--warm_start", default="")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_pipeline"))
    p.add_argument("--warmup_steps", type=int, default=20,
                   help="steps of the untimed run that fills the XLA cache (0: none)")
    p.add_argument("--xla_cache", default=os.environ.get("PIPELINERL_JAX_CACHE", ""),
                   help="XLA cache every run shares (default $PIPELINERL_JAX_CACHE, else "
                        "OUT/xla_cache)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cache = args.xla_cache if args.xla_cache == "off" else os.path.abspath(
        args.xla_cache or os.path.join(args.out, "xla_cache"))
    env = dict(os.environ, PYTHONPATH=ROOT, PIPELINERL_JAX_CACHE=cache)

    warm = args.warm_start
    if not warm:
        warm = os.path.join(args.out, "warm_start", "model")
        if not os.path.isdir(warm):
            subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "sft.py"),
                            "--config=" + os.path.join(ROOT, "configs", "default.py"),
                            f"--workdir={os.path.dirname(warm)}"], check=True, cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL)
    from pipelinerl_jax.models import load_config
    from scripts.bench_model import matmul_gflops
    params = load_config(warm).num_params
    peak = matmul_gflops()

    common = [f"--config.warm_start.checkpoint={warm}", f"--config.learner.total_steps={args.steps}",
              f"--config.learner.eval_every={args.eval_every}"]
    variants = [("sync", ["--config.mode=sync"])] + [
        (f"async_lag{k}", ["--config.mode=async", f"--config.max_lag={k}"])
        for k in map(int, args.max_lags.split(","))]
    out = {"bench": "pipeline", "target_accuracy": args.target, "steps": args.steps,
           "model_params": params, "matmul_fp32_gflops": round(peak, 1), "xla_cache": cache,
           "warmup": None, "runs": {}}
    if args.warmup_steps and cache != "off":  # without a cache every run compiles anyway
        out["warmup"] = warm_up(warm, args.warmup_steps, args.out, env)
        out["warmup"]["cache_entries_after"] = cache_entries(cache)
        print("warmup", json.dumps(out["warmup"]), file=sys.stderr, flush=True)
    for name, flags in variants:
        workdir = os.path.join(args.out, name)
        before, new = cache_entries(cache), None  # None: an earlier invocation's run
        if not os.path.exists(os.path.join(workdir, "summary.json")):
            run(workdir, common + flags, env)
            new = cache_entries(cache) - before
        out["runs"][name] = summarise(workdir, args.target, params, peak)
        out["runs"][name]["new_cache_entries"] = new
        print(name, json.dumps(out["runs"][name]), file=sys.stderr, flush=True)
    sync_t = out["runs"]["sync"]["time_to_target_s"]
    out["speedup_vs_sync"] = {
        name: (round(sync_t / r["time_to_target_s"], 2)
               if sync_t and r["time_to_target_s"] else None)
        for name, r in out["runs"].items() if name != "sync"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
