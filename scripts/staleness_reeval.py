"""Re-evaluates the final checkpoint of every finished run of a grid on a larger held-out set.

The grid scores each run on the first 256 problems of the fixed held-out split. Between two
losses run on the same seed, the part of the difference that comes from *which* problems
are in the set shrinks like 1/sqrt(problems): re-scoring every run's last checkpoint on the
first N problems of the same split (N = 2048 by default; the first 256 are the grid's own set)
lowers the noise of each seed-paired comparison without a new training run.

One process, one evaluation engine (compiled once), one checkpoint after another; resumable
(runs already in the output CSV are skipped). Each row also re-scores the grid's own 256 and
records the accuracy the run logged, so the output says whether this re-evaluation
reproduces the grid's figure (greedy decoding; the engine's batching can move last bits).

    PYTHONPATH=. python scripts/staleness_reeval.py --results=/work/study/main \\
        --out=results/staleness_study/main/reeval_2048.csv [--eval_size=2048] [--only=lag=4,]

Prints one JSON line at the end (runs scored, seconds per run, agreement with the grid).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

FIELDS = ("run", "step", "version", "eval_size", "accuracy", "accuracy_256",
          "logged_accuracy_256", "seconds")


def finished_runs(results: str, only: str = ""):
    """(name, run directory) of every finished run with a committed checkpoint, sorted."""
    from pipelinerl_jax.learner.checkpoint import committed_steps
    runs = os.path.join(results, "runs")
    for name in sorted(os.listdir(runs)):
        d = os.path.join(runs, name)
        if only and only not in name:
            continue
        try:
            with open(os.path.join(d, "status.json")) as f:
                if json.load(f).get("status") != "done":
                    continue
        except (OSError, ValueError):
            continue
        if committed_steps(os.path.join(d, "checkpoints")):
            yield name, d


def logged_last_accuracy(run_dir: str):
    """The last `eval/accuracy` the run logged (metrics.jsonl), or None."""
    last = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "eval/accuracy" in rec:
                last = rec["eval/accuracy"]
    return last


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="a grid's workdir (holding runs/)")
    p.add_argument("--out", required=True, help="CSV to write (appended to; resumable)")
    p.add_argument("--eval_size", type=int, default=2048)
    p.add_argument("--only", default="", help="re-score only runs whose name contains this")
    p.add_argument("--limit", type=int, default=0, help="stop after this many new runs")
    a = p.parse_args(argv)

    from pipelinerl_jax import compile_cache
    compile_cache.enable()
    import ml_collections
    import numpy as np
    from pipelinerl_jax.learner.checkpoint import Checkpointer
    from pipelinerl_jax.models import flat_params
    from pipelinerl_jax.rollout.evaluator import Evaluator
    from pipelinerl_jax.envs import build_task
    from pipelinerl_jax.tokenizer import get_tokenizer

    done = set()
    if os.path.exists(a.out):
        with open(a.out) as f:
            done = {r["run"] for r in csv.DictReader(f) if int(r["eval_size"]) == a.eval_size}
    todo = [(n, d) for n, d in finished_runs(a.results, a.only) if n not in done]
    if a.limit:
        todo = todo[:a.limit]
    evaluator, shape, version, rows = None, None, 0, []
    new_file = not os.path.exists(a.out)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new_file:
            w.writeheader()
        for name, d in todo:
            t0 = time.time()
            with open(os.path.join(d, "config.json")) as cf:
                cfg = ml_collections.ConfigDict(json.load(cf))
            # every run of one grid must share the model and the engine the evaluator holds
            key = json.dumps([cfg.model.to_dict(), cfg.engine.to_dict(), cfg.task.to_dict(),
                              cfg.tokenizer.to_dict() if hasattr(cfg.tokenizer, "to_dict")
                              else cfg.tokenizer], sort_keys=True)
            if evaluator is None or key != shape:
                if evaluator is not None:
                    evaluator.close()
                cfg.learner.eval_size = a.eval_size
                with open(os.path.join(d, "init_checkpoint.txt")) as cf:
                    init = cf.read().strip()
                evaluator = Evaluator.embedded(cfg, init, build_task(cfg),
                                               get_tokenizer(cfg.tokenizer))
                shape = key
                if evaluator.runner is not None:
                    raise SystemExit(f"{d}: an environment task (multi-turn episodes); this "
                                     "script re-scores single-turn tasks only")
            ckpt = Checkpointer(os.path.join(d, "checkpoints"), async_save=False)
            try:
                state, meta, step = ckpt.read_state()
            finally:
                ckpt.close()
            version += 1
            evaluator.engine.update_weights(flat_params(state["params"]), version)
            correct, _ = evaluator.correct(version)
            row = {"run": name, "step": step, "version": meta.get("version"),
                   "eval_size": a.eval_size, "accuracy": float(correct.mean()),
                   "accuracy_256": float(correct[:256].mean()),
                   "logged_accuracy_256": logged_last_accuracy(d),
                   "seconds": round(time.time() - t0, 2)}
            w.writerow(row)
            f.flush()
            rows.append(row)
            print(f"{name}: {row['accuracy']:.4f} on {a.eval_size} (256: "
                  f"{row['accuracy_256']:.4f}, logged {row['logged_accuracy_256']}) "
                  f"{row['seconds']} s", file=sys.stderr, flush=True)
    if evaluator is not None:
        evaluator.close()
    agree = [r for r in rows if r["logged_accuracy_256"] is not None]
    out = {"runs": len(rows), "skipped_already_scored": len(done),
           "eval_size": a.eval_size,
           "seconds_per_run": round(float(np.mean([r["seconds"] for r in rows])), 2)
           if rows else None,
           "same_256_accuracy_as_logged": sum(
               abs(r["accuracy_256"] - r["logged_accuracy_256"]) < 1e-9 for r in agree),
           "max_abs_diff_256_vs_logged": max(
               (abs(r["accuracy_256"] - r["logged_accuracy_256"]) for r in agree), default=None)}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
