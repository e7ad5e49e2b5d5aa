"""Sync vs async on the sampler-bound workload: measured time-to-target beside the simulator.

    PYTHONPATH=. python scripts/sampler_bound_report.py --results=runs/sb [--target_accuracy=0.3]

`--results` is a grid directory of `configs/ablate/sampler_bound.py` (or any folder of run
directories with sync and async runs). Per schedule (sync, async1, async2, ...) over its seeds:
time to the target held-out accuracy as the ablation runner's runs.csv computes it
(`time_to_target_s`: wall-clock of the first evaluation at or above the target), the same with
held-out evaluation time taken out (evaluation blocks the learner and is not part of either
schedule's RL step; `scripts/bench_pipeline.py` does the same), steps to target, seconds per
step without evaluation, and the speedups over sync (ratio of seed means, with a 95%
bootstrap interval over seeds).

The simulator (`pipelinerl_jax/sim`) is calibrated from each sync run's own logs
(`sim.calibrate.read_run`: lengths, decode-step and train-step fits, weight-sync time) and
simulates this machine's two schedules: sync as one sampler core and one learner core taking
turns (one device that samples, then trains), async as one sampler and one learner with the
run's `max_lag`. Its predicted step speedup is sync's simulated step time over async's; its
predicted speedup to target multiplies each schedule's simulated step time by its measured
mean steps to target (the simulator models time, not learning). Both leave evaluation out, so
compare them with the "excl. eval" columns.

Also the balance the workload is designed for, from the sync runs' logs: the learner's wait
for a batch (sampling) against its train step, per step (steps right after an evaluation left
out: their batch was sampled while the learner evaluated), and sampler slot occupancy.
Prints a markdown table, then one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
from scipy import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipelinerl_jax.ablation.results import Run, load_run, load_runs, summarize_run  # noqa: E402
from pipelinerl_jax.metrics import eval_on_learner_step  # noqa: E402
from pipelinerl_jax.sim.calibrate import calibrated_setup, embedded_cpu_base, read_run  # noqa: E402
from pipelinerl_jax.sim.pipeline import simulate  # noqa: E402

GOAL_SPEEDUP = 1.8  # issue 16: async >= 1.8x sync to the same held-out accuracy
# A train step this many times the run's median step compiled (a new packed-row bucket): left
# out of the balance and of the simulator's train-time fit.
COMPILE_OUTLIER = 3.0


def _compiled(rows: Sequence[dict]) -> set:
    """Steps whose train step took over COMPILE_OUTLIER x the median (they compiled)."""
    times = [r["learner/step_time_s"] for r in rows if "learner/step_time_s" in r]
    if not times:
        return set()
    cut = COMPILE_OUTLIER * float(np.median(times))
    return {r["step"] for r in rows if r.get("learner/step_time_s", 0.0) > cut}


def schedule_of(run: Run) -> str:
    """The run's schedule label: its grid label, else 'sync' or 'async<max_lag>'."""
    if "schedule" in run.labels:
        return run.labels["schedule"]
    return "sync" if run.get("mode") == "sync" else f"async{run.get('max_lag')}"


def is_sync(label: str) -> bool:
    """'sync' (the async runs' engine) or another sync baseline ('sync128': its engine sized
    to what sync can fill)."""
    return label.startswith("sync")


def _order(label: str):
    digits = "".join(ch for ch in label if ch.isdigit())
    return (not is_sync(label), label != "sync", int(digits) if digits else 0, label)


def target_of(results: str, override) -> object:
    """--target_accuracy (a number or 'auto'), else the grid's `analysis.target_accuracy`
    (summary.json, then ablation.json)."""
    if override is not None:
        return "auto" if str(override) == "auto" else float(override)
    for name in ("summary.json", "ablation.json"):
        try:
            with open(os.path.join(results, name)) as f:
                return float(json.load(f)["analysis"]["target_accuracy"])
        except (OSError, KeyError, TypeError, ValueError):
            continue
    raise SystemExit(f"{results}: no analysis.target_accuracy in summary.json or "
                     "ablation.json; pass --target_accuracy")


def auto_target(groups: Dict[str, List[Run]]) -> float:
    """Three quarters of the way from the step-0 accuracy to the best accuracy every schedule
    reaches (seed means), as `ablation/figures.sync_vs_async` picks one: a target every
    schedule passes, not the last evaluation of the slowest."""
    runs = [r for rs in groups.values() for r in rs if r.evals]
    start = float(np.mean([r.evals[0][2] for r in runs]))
    reach = min(float(np.mean([max(a for _, _, a in r.evals) for r in rs if r.evals]))
                for rs in groups.values())
    return start + 0.75 * (reach - start)


def eval_free_time_to_target(run: Run, target: float) -> Optional[float]:
    """Wall-clock to the first evaluation at or above `target`, less every evaluation's
    `eval/time_s` up to and including it when evaluations ran on the learner's step."""
    spent, blocking = 0.0, eval_on_learner_step(run.path)
    for r in run.rows:
        spent += float(r.get("eval/time_s") or 0.0) if blocking else 0.0
        acc = r.get("eval/accuracy")
        if isinstance(acc, (int, float)) and acc >= target:
            return float(r["wall_time_s"]) - spent
    return None


def seconds_per_step(run: Run) -> Optional[float]:
    """Wall-clock per trained step, evaluation time taken out."""
    last = run.rows[-1]
    steps = int(last.get("step", 0))
    if steps <= 0:
        return None
    evals = (sum(float(r.get("eval/time_s") or 0.0) for r in run.rows)
             if eval_on_learner_step(run.path) else 0.0)
    return (float(last["wall_time_s"]) - evals) / steps


def sync_balance(run: Run) -> dict:
    """Per-step means over the sync run's steps (the first, those right after an evaluation
    and those that compiled left out): wait for the batch vs train step, and sampler
    occupancy."""
    keep, prev_eval, compiled = [], True, _compiled(run.rows)  # step 1 follows step 0's eval
    for r in run.rows:
        if r.get("step", 0) > 0 and not prev_eval and "learner/step_time_s" in r \
                and r["step"] not in compiled:
            keep.append(r)
        prev_eval = "eval/accuracy" in r
    if not keep:
        return {}
    wait = float(np.mean([r.get("learner/wait_time_s", 0.0) for r in keep]))
    train = float(np.mean([r["learner/step_time_s"] for r in keep]))
    sync = float(np.mean([r.get("weight_sync/time_s", 0.0) for r in keep]))
    occ = [r["sampler/occupancy"] for r in keep if "sampler/occupancy" in r]
    return {"steps": len(keep), "wait_time_s": wait, "step_time_s": train,
            "weight_sync_s": sync, "sampling_over_training": wait / train if train else None,
            "learner_idle_fraction": wait / (wait + train + sync) if wait + train else None,
            "sampler_occupancy": float(np.mean(occ)) if occ else None}


def _train_fit(run_dir: str, fallback: tuple) -> tuple:
    """Train step time = c + d·tokens over the run's steps, the first and the ones that
    compiled left out (`read_run` drops only the first)."""
    rows = [r for r in load_run(run_dir).rows
            if r.get("step", 0) > 1 and "learner/tokens" in r and "learner/step_time_s" in r]
    compiled = _compiled(rows)
    rows = [r for r in rows if r["step"] not in compiled]
    x = np.asarray([r["learner/tokens"] for r in rows], float)
    y = np.asarray([r["learner/step_time_s"] for r in rows], float)
    if x.size < 3:
        return fallback
    if np.ptp(x) == 0:
        return float(y.mean()), 0.0
    d, c = np.polyfit(x, y, 1)
    return float(c), float(d)


def simulate_schedules(run_dir: str, max_lags: Sequence[int]) -> dict:
    """Simulated seconds per step of sync and of async at each max_lag, calibrated from one
    run directory (a sync run of the workload)."""
    m = read_run(run_dir)
    m = dataclasses.replace(m, train_fit=_train_fit(run_dir, m.train_fit))
    s = calibrated_setup(m, embedded_cpu_base(512))
    # This machine's sync: one sampler core and one learner core taking turns, i.e. one
    # device that samples and then trains (calibrated_setup would let both cores do each).
    sync = dataclasses.replace(s, mode="sync", devices=1, samplers=1, trainers=1, max_lag=None)
    out = {"sync": simulate(sync).summary()["step_time_s"]}
    for k in max_lags:
        a = dataclasses.replace(s, mode="async", devices=2, samplers=1, trainers=1,
                                max_lag=int(k), queue_capacity_batches=math.inf)
        out[f"async{k}"] = simulate(a).summary()["step_time_s"]
    out["fit"] = {"decode_step_s": list(m.decode_fit), "train_step_s": list(m.train_fit),
                  "weight_sync_s": m.weight_sync_s,
                  "response_length_mean": float(m.lengths.mean()),
                  "response_length_max": int(m.lengths.max())}
    return out


def _mean_ci(xs: Sequence[float]) -> tuple:
    """(mean, 95% t half-width or None)."""
    xs = np.asarray(xs, float)
    if xs.size == 0:
        return None, None
    if xs.size == 1:
        return float(xs[0]), None
    half = stats.t.ppf(0.975, xs.size - 1) * xs.std(ddof=1) / math.sqrt(xs.size)
    return float(xs.mean()), float(half)


def _ratio_ci(num: Sequence[float], den: Sequence[float], n: int = 2000, seed: int = 0):
    """mean(num) / mean(den) and a 95% bootstrap interval (seeds resampled independently)."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    if num.size == 0 or den.size == 0 or den.mean() <= 0:
        return None, None
    point = float(num.mean() / den.mean())
    if num.size < 2 or den.size < 2:
        return point, None
    rng = np.random.default_rng(seed)
    a = num[rng.integers(num.size, size=(n, num.size))].mean(1)
    b = den[rng.integers(den.size, size=(n, den.size))].mean(1)
    lo, hi = np.percentile(a / b, [2.5, 97.5])
    return point, [float(lo), float(hi)]


def report(results: str, target_accuracy=None, with_sim: bool = True) -> dict:
    """Everything the report prints (see the module doc); `target_accuracy`: a number,
    'auto' (`auto_target`) or None (the grid's)."""
    target = target_of(results, target_accuracy)
    runs, problems = load_runs([results])
    runs = [r for r in runs if not r.get("lag_injection.enabled", False)]
    groups: Dict[str, List[Run]] = {}
    for r in runs:
        groups.setdefault(schedule_of(r), []).append(r)
    if "sync" not in groups or len(groups) < 2:
        raise SystemExit(f"{results}: needs sync and async runs (found {sorted(groups)}; "
                         f"problems: {problems})")
    if target == "auto":
        target = auto_target(groups)
    analysis = {"target_accuracy": target}
    sched = {}
    for label in sorted(groups, key=_order):
        rs = groups[label]
        summ = [summarize_run(r, analysis) for r in rs]
        ttt = [s["time_to_target_s"] for s in summ]
        free = [eval_free_time_to_target(r, target) for r in rs]
        stt = [s["steps_to_target"] for s in summ]
        sps = [x for x in (seconds_per_step(r) for r in rs) if x is not None]
        all_hit = all(t is not None for t in ttt)
        sched[label] = {
            "runs": len(rs), "reached": sum(t is not None for t in ttt),
            "seeds": sorted(str(r.labels.get("seed", r.get("seed"))) for r in rs),
            "time_to_target_s": ttt, "time_to_target_excl_eval_s": free,
            "steps_to_target": stt,
            "time_to_target_mean_s": _mean_ci(ttt)[0] if all_hit else None,
            "time_to_target_ci95_s": _mean_ci(ttt)[1] if all_hit else None,
            "time_to_target_excl_eval_mean_s": _mean_ci(free)[0] if all_hit else None,
            "steps_to_target_mean": _mean_ci(stt)[0] if all_hit else None,
            "final_eval_accuracy_mean": _mean_ci([s["final_eval_accuracy"] for s in summ
                                                  if s["final_eval_accuracy"] is not None])[0],
            "seconds_per_step_excl_eval": _mean_ci(sps)[0],
            "max_lag": None if is_sync(label) else rs[0].get("max_lag"),
        }
    # Speedups are against the fastest sync baseline to the target: an async schedule must
    # beat sync at its best, not sync on an engine sized for async.
    baselines = [k for k in sched if is_sync(k) and sched[k]["time_to_target_mean_s"]]
    reference = min(baselines, key=lambda k: sched[k]["time_to_target_mean_s"]) \
        if baselines else "sync"
    sync = sched[reference]
    for label, s in sched.items():
        if is_sync(label):
            continue
        hit = s["time_to_target_mean_s"] is not None and sync["time_to_target_mean_s"] is not None
        s["speedup_to_target"], s["speedup_to_target_ci95"] = _ratio_ci(
            sync["time_to_target_s"], s["time_to_target_s"]) if hit else (None, None)
        s["speedup_to_target_excl_eval"], s["speedup_to_target_excl_eval_ci95"] = _ratio_ci(
            sync["time_to_target_excl_eval_s"], s["time_to_target_excl_eval_s"]) \
            if hit else (None, None)
        s["step_speedup_excl_eval"] = (sync["seconds_per_step_excl_eval"]
                                       / s["seconds_per_step_excl_eval"]
                                       if s["seconds_per_step_excl_eval"] else None)

    balance = [sync_balance(r) for r in groups["sync"]]
    balance = [b for b in balance if b]
    keys = ("wait_time_s", "step_time_s", "sampling_over_training", "learner_idle_fraction",
            "sampler_occupancy")
    sync_bal = {k: float(np.mean([b[k] for b in balance if b.get(k) is not None]))
                for k in keys if any(b.get(k) is not None for b in balance)}

    sim = None
    if with_sim:
        lags = [s["max_lag"] for label, s in sched.items() if not is_sync(label)]
        preds, errors = [], []
        for r in groups["sync"]:
            try:
                preds.append(simulate_schedules(r.path, lags))
            except (OSError, ValueError, KeyError, TypeError) as e:
                errors.append(f"{r.path}: {e}")
        sim = {"calibrated_from": len(preds), "errors": errors}
        if preds:
            sim["step_time_s"] = {k: float(np.mean([p[k] for p in preds]))
                                  for k in preds[0] if k != "fit"}
            sim["fit"] = preds[0]["fit"]
            t_sync = sim["step_time_s"]["sync"]
            same = sched["sync"]  # the simulator models sync on the async runs' engine
            for label, s in sched.items():
                if is_sync(label) or label not in sim["step_time_s"]:
                    continue
                t = sim["step_time_s"][label]
                s["sim_step_speedup"] = t_sync / t
                s["sim_speedup_to_target"] = (
                    same["steps_to_target_mean"] * t_sync / (s["steps_to_target_mean"] * t)
                    if s["steps_to_target_mean"] and same["steps_to_target_mean"] else None)
    best = max((s.get("speedup_to_target") or 0.0 for label, s in sched.items()
                if not is_sync(label)), default=0.0)
    return {"report": "sampler_bound", "results": os.path.abspath(results),
            "target_accuracy": target, "schedules": sched, "reference": reference,
            "sync_balance": sync_bal,
            "simulator": sim, "best_speedup_to_target": best or None,
            "goal_speedup": GOAL_SPEEDUP, "goal_met": bool(best >= GOAL_SPEEDUP),
            "problems": problems}


def _f(x, fmt="{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ci(point, ci) -> str:
    if point is None:
        return "—"
    return f"{point:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def markdown(out: dict) -> str:
    lines = [f"Target held-out accuracy {out['target_accuracy']:.0%}; means over seeds, "
             "95% intervals (t for times, bootstrap over seeds for speedups). Measured "
             f"speedups are against `{out['reference']}`, the fastest sync baseline; the "
             "simulator's against sync on the async runs' engine.", "",
             "| schedule | runs (reached) | time to target s | excl. eval s | steps to target "
             "| final acc | s/step excl. eval | speedup to target | excl. eval | step speedup "
             "| sim step speedup | sim speedup to target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, s in out["schedules"].items():
        m, h = s["time_to_target_mean_s"], s["time_to_target_ci95_s"]
        ttt = "—" if m is None else f"{m:.1f}" + (f" ± {h:.1f}" if h is not None else "")
        sync = is_sync(label)
        lines.append(
            f"| {label} | {s['runs']} ({s['reached']}) | {ttt} "
            f"| {_f(s['time_to_target_excl_eval_mean_s'])} | {_f(s['steps_to_target_mean'])} "
            f"| {_f(s['final_eval_accuracy_mean'], '{:.1%}')} "
            f"| {_f(s['seconds_per_step_excl_eval'], '{:.2f}')} "
            f"| {'1' if sync else _ci(s.get('speedup_to_target'), s.get('speedup_to_target_ci95'))} "
            f"| {'1' if sync else _ci(s.get('speedup_to_target_excl_eval'), s.get('speedup_to_target_excl_eval_ci95'))} "
            f"| {'1' if sync else _f(s.get('step_speedup_excl_eval'), '{:.2f}x')} "
            f"| {'1' if sync else _f(s.get('sim_step_speedup'), '{:.2f}x')} "
            f"| {'1' if sync else _f(s.get('sim_speedup_to_target'), '{:.2f}x')} |")
    b = out["sync_balance"]
    if b:
        lines += ["", f"Sync balance (per step, means over sync runs): learner waits "
                  f"{b.get('wait_time_s', math.nan):.2f} s for sampling vs "
                  f"{b.get('step_time_s', math.nan):.2f} s training "
                  f"(sampling/training {b.get('sampling_over_training', math.nan):.2f}, learner idle "
                  f"{b.get('learner_idle_fraction', math.nan):.0%}); sampler slot occupancy "
                  f"{b.get('sampler_occupancy', math.nan):.1%}."]
    sim = out["simulator"]
    if sim and sim.get("step_time_s"):
        steps = ", ".join(f"{k} {v:.2f} s" for k, v in sim["step_time_s"].items())
        lines += ["", f"Simulator calibrated from {sim['calibrated_from']} sync run(s): "
                  f"step time {steps}."]
    missed = [label for label, s in out["schedules"].items() if s["reached"] < s["runs"]]
    if missed:
        lines += ["", f"Not every run of {', '.join(missed)} reached the target: those "
                  "schedules have no mean time to it (try --target_accuracy=auto)."]
    lines += ["", f"Best async speedup to target: {_f(out['best_speedup_to_target'], '{:.2f}x')} "
              f"(goal >= {out['goal_speedup']}x: {'met' if out['goal_met'] else 'not met'})."]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", required=True, help="grid directory (or folder of run dirs)")
    p.add_argument("--target_accuracy", default=None,
                   help="a number, or 'auto' (3/4 of the way from the warm start to the best "
                        "accuracy every schedule reaches); default: the grid's "
                        "analysis.target_accuracy")
    p.add_argument("--no_sim", action="store_true", help="skip the simulator's prediction")
    args = p.parse_args(argv)
    out = report(args.results, args.target_accuracy, with_sim=not args.no_sim)
    print(markdown(out))
    print(json.dumps(out, default=str))
    return out


if __name__ == "__main__":
    main()
