"""Every figure of docs/experiments.md, drawn from logged run directories (never from numbers
typed in): `make_all(roots, out)` finds the runs under `roots`, picks for each figure the runs
it needs by their config, and writes `<name>.png` and `<name>.svg` for each figure it can.

  sync_vs_async      reward and held-out accuracy vs wall-clock, sync vs async per max_lag,
                     speedup to a target accuracy annotated (runs without lag injection)
  lag_ablation       final held-out accuracy vs injected lag per loss, mean and 95% t-interval
                     over seeds
  diagnostics_by_lag ESS, clip fraction and KL(behaviour || current) per lag bucket per loss
  ess_vs_drop        stalest-bucket ESS per lag and loss, and ESS vs the accuracy drop from
                     lag 0 per cell (study_figures.py)
  repro_<name>       the published-phenomenon experiments of configs/repro (study_figures.py)
  kv_policy          kv_policy keep vs recompute at matched max_lag (async runs)
  occupancy_vs_sim   sampler slot occupancy and learner idle fraction over time, sync and async,
                     measured beside the simulator calibrated from the same run
  lengths_and_lag    the task's response-length distribution and the per-token lag histogram

A figure whose runs are absent is skipped with the reason; a run directory that is missing or
malformed is reported by name (results.load_runs) and left out. `roots` may also be folders
of committed tables (results.export_tables): every figure but occupancy_vs_sim (which
calibrates the simulator from a run directory's raw logs) draws from them.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.ablation import stats, study_figures
from pipelinerl_jax.ablation.plotting import Skip, plt
from pipelinerl_jax.ablation.plotting import colors as _colors
from pipelinerl_jax.ablation.plotting import save as _save
from pipelinerl_jax.ablation.plotting import smooth as _smooth
from pipelinerl_jax.ablation.results import (LAG_BUCKETS, Run, lag_hist, load_run, load_runs,
                                             raw_dir, response_lengths)
from pipelinerl_jax.ablation.staleness import collapsed_runs, loss_label
from pipelinerl_jax.metrics import read_jsonl

__all__ = ["FIGURES", "Skip", "make_all"]


def _injected(r: Run) -> bool:
    return bool(r.get("lag_injection.enabled", False))


def _schedule_label(r: Run) -> str:
    """The grid's own schedule label when it has one (`sync128`, `auto`: runs of one mode
    and max_lag that differ elsewhere stay apart), else the mode and max_lag."""
    if (r.labels or {}).get("schedule"):
        return r.labels["schedule"]
    return "sync" if r.get("mode") == "sync" else f"async, max_lag={r.get('max_lag')}"


def _schedule_order(label: str):
    digits = "".join(ch for ch in label.rsplit("=", 1)[-1] if ch.isdigit())
    return (not label.startswith("sync"), label != "sync", int(digits) if digits else 99, label)


def _injected_order(label: str):
    return int(label.rsplit("=", 1)[1])


def _groups(runs: Sequence[Run], key: Callable[[Run], str]) -> Dict[str, List[Run]]:
    out: Dict[str, List[Run]] = {}
    for r in runs:
        out.setdefault(key(r), []).append(r)
    return out


def _swept(runs: Sequence[Run], axis: str) -> List[Run]:
    """The runs of grids that sweep `axis` (runs labelled with it), or all runs if none are:
    a figure about schedules must not pool, say, a kv_policy grid's async runs of another
    workload with a schedule grid's."""
    return [r for r in runs if axis in (r.labels or {})] or list(runs)


def _time_to(r: Run, target: float) -> Optional[float]:
    return next((t for _, t, a in r.evals if a >= target), None)


# ============================================================================ figures

def sync_vs_async(runs: Sequence[Run], out: str, target: Optional[float] = None) -> dict:
    """Reward and held-out accuracy vs wall-clock per schedule (sync, async per max_lag), the
    time each schedule first reaches `target` (the grid's `analysis.target_accuracy`, or if
    that is absent or not reached by every schedule, 3/4 of the way from the warm start to the
    best accuracy every schedule reaches) and the async speedup over sync to it."""
    runs = _swept([r for r in runs if not _injected(r) and r.evals], "schedule")
    if any(r.get("engine.kv_policy") == "keep" for r in runs):
        runs = [r for r in runs if r.get("engine.kv_policy", "keep") == "keep"]
    groups = _groups(runs, _schedule_label)
    if not any(g.startswith("sync") for g in groups) or len(groups) < 2:
        raise Skip("needs sync and async runs without lag injection (configs/ablate/"
                   "sync_vs_async.py)")
    labels = sorted(groups, key=_schedule_order)
    reach = min(np.mean([max(a for _, _, a in r.evals) for r in groups[g]]) for g in labels)
    if target is None or target > reach:
        # Three quarters of the way from the warm start to the best accuracy every schedule
        # reaches: a target they all pass, not the last evaluation of the slowest.
        start = float(np.mean([r.evals[0][2] for r in runs]))
        target = start + 0.75 * (reach - start)
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    facts = {"target_accuracy": float(target), "schedules": {}}
    for label, color in zip(labels, _colors(len(labels))):
        ttt = []
        for i, r in enumerate(groups[label]):
            _, t, v = r.series("reward/mean")
            ax_r.plot(t / 60, _smooth(v, 5), color=color, lw=1.3, alpha=0.9,
                      label=label if i == 0 else None)
            _, t, v = r.series("eval/accuracy")
            ax_a.plot(t / 60, v, "o-", color=color, ms=3, lw=1.3,
                      label=label if i == 0 else None)
            ttt.append(_time_to(r, target))
        reached = [x for x in ttt if x is not None]
        mean_t = float(np.mean(reached)) if len(reached) == len(ttt) else None
        facts["schedules"][label] = {
            "runs": len(ttt), "time_to_target_s": mean_t,
            "final_eval_accuracy": float(np.mean([r.evals[-1][2] for r in groups[label]])),
            "steps_per_min": float(np.mean([60 * r.rows[-1]["step"] / r.rows[-1]["wall_time_s"]
                                            for r in groups[label]]))}
        if mean_t is not None:
            ax_a.plot([mean_t / 60], [target], "*", color=color, ms=12, mec="k", mew=0.5)
    ax_a.axhline(target, color="gray", ls=":", lw=1)
    # against the fastest sync baseline (e.g. sync on an engine sized to what it fills)
    syncs = [g for g in labels if g.startswith("sync")
             and facts["schedules"][g]["time_to_target_s"] is not None] or ["sync"]
    ref = min(syncs, key=lambda g: facts["schedules"].get(g, {}).get("time_to_target_s") or 0)
    sync_t = facts["schedules"].get(ref, {}).get("time_to_target_s")
    facts["reference"] = ref
    best = None
    for label in [g for g in labels if not g.startswith("sync")]:
        t = facts["schedules"][label]["time_to_target_s"]
        if sync_t and t:
            facts["schedules"][label]["speedup_to_target"] = sync_t / t
            if best is None or sync_t / t > best[1]:
                best = (label, sync_t / t, t)
    if best:
        facts["best_async"], facts["speedup_to_target"] = best[0], best[1]
        ax_a.text(0.02, 0.97, f"to {target:.0%} held-out accuracy:\n{best[0]} {best[1]:.2f}x "
                  f"faster than {ref}\n({best[2] / 60:.1f} vs {sync_t / 60:.1f} min)",
                  transform=ax_a.transAxes, va="top", fontsize=9,
                  bbox=dict(boxstyle="round", fc="white", alpha=0.85))
    ax_r.set(xlabel="wall-clock (min)", ylabel="train reward (5-step mean)",
             title="reward vs wall-clock")
    ax_a.set(xlabel="wall-clock (min)", ylabel="held-out greedy accuracy",
             title="accuracy vs wall-clock")
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    facts["path"] = _save(fig, out, "sync_vs_async")
    return facts


def _cell_stats(runs: Sequence[Run], fn) -> tuple:
    """(mean, half-width of the 95% t-interval over the runs (0 with one run), n)."""
    iv = stats.t_interval([v for v in (fn(r) for r in runs) if v is not None])
    return iv.mean, iv.half if math.isfinite(iv.half) else 0.0, iv.n


def lag_ablation(runs: Sequence[Run], out: str) -> dict:
    """Final held-out accuracy vs injected lag, one line per loss: mean and 95% t-interval
    over seeds (left) and the mean KL(behaviour || current) with its interval (right); a
    cross marks a cell where a run collapsed (non-finite steps, an accuracy collapse or a
    diverged run)."""
    runs = [r for r in runs if _injected(r) and r.evals]
    if not runs:
        raise Skip("needs runs with lag_injection.enabled (configs/ablate/staleness.py)")
    losses = _groups(runs, loss_label)
    lags = sorted({int(r.get("lag_injection.k", 0)) for r in runs})
    xpos = {k: i for i, k in enumerate(lags)}
    fig, (ax, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.2))
    facts = {"lags": lags, "losses": {}}
    init = [r.evals[0][2] for r in runs if r.evals[0][0] == 0]
    for (loss, rs), color in zip(sorted(losses.items()), _colors(len(losses))):
        by_lag = _groups(rs, lambda r: int(r.get("lag_injection.k", 0)))
        ks = sorted(by_lag)
        acc = [_cell_stats(by_lag[k], lambda r: r.evals[-1][2]) for k in ks]
        kl = [_cell_stats(by_lag[k], lambda r: _mean_metric(r, "loss/kl_k3")) for k in ks]
        x = np.asarray([xpos[k] for k in ks], float) + (list(losses).index(loss) - len(losses) / 2) * 0.03
        ax.errorbar(x, [a[0] for a in acc], yerr=[a[1] for a in acc], color=color, marker="o",
                    ms=4, lw=1.4, capsize=2, label=loss)
        ax_kl.errorbar(x, [k[0] for k in kl], yerr=[k[1] for k in kl], color=color,
                       marker="o", ms=4, lw=1.4, capsize=2)
        bad = [(xx, a[0]) for xx, k, a in zip(x, ks, acc) if collapsed_runs(by_lag[k])]
        if bad:
            ax.plot(*zip(*bad), "x", color="k", ms=7)
        facts["losses"][loss] = {str(k): {"final_eval_accuracy_mean": a[0],
                                          "final_eval_accuracy_ci95_half": a[1], "seeds": a[2],
                                          "kl_k3_mean": kv[0]}
                                 for k, a, kv in zip(ks, acc, kl)}
    if init:
        ax.axhline(float(np.mean(init)), color="gray", ls=":", lw=1, label="warm start")
    for a in (ax, ax_kl):
        a.set_xticks(range(len(lags)), [str(k) for k in lags])
        a.set_xlabel("injected lag k (versions)")
        a.grid(alpha=0.3)
    seeds = max(len(v) for v in _groups(runs, lambda r: r.cell).values())
    ax.set(ylabel="final held-out greedy accuracy",
           title=f"accuracy vs staleness (mean, 95% t-interval, {seeds} seed"
                 f"{'s' * (seeds > 1)}; x = collapsed)")
    ax_kl.set(ylabel="mean KL(behaviour || current), k3", title="off-policy drift during training")
    ax_kl.set_yscale("symlog", linthresh=1e-3)
    ax_kl.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    facts["path"] = _save(fig, out, "lag_ablation")
    return facts


def _mean_metric(r: Run, key: str) -> Optional[float]:
    _, _, v = r.series(key)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else None


def _bucket_mean(rs: Sequence[Run], b: str, name: str) -> Optional[float]:
    num = den = 0.0
    for r in rs:
        for row in r.rows:
            n, v = row.get(f"loss/lag_{b}/tokens"), row.get(f"loss/lag_{b}/{name}")
            if isinstance(n, (int, float)) and n > 0 and isinstance(v, (int, float)) \
                    and math.isfinite(v):
                num, den = num + n * v, den + n
    return num / den if den > 0 else None


def diagnostics_by_lag(runs: Sequence[Run], out: str) -> dict:
    """Per lag bucket and loss: token ESS, clip fraction and KL k3 (`loss/lag_<bucket>/
    <name>`). A seed's value is the token-weighted mean over every logged step of the loss's
    runs of that seed; the figure shows the mean over seeds and its 95% t-interval."""
    runs = [r for r in runs if any(f"loss/lag_{b}/tokens" in r.rows[-1] for b in LAG_BUCKETS)]
    if not runs:
        raise Skip("needs runs that log per-lag diagnostics (loss/lag_<bucket>/...)")
    losses = _groups(runs, loss_label)
    names = (("ess", "token ESS"), ("clip_frac", "clip fraction"), ("kl_k3", "KL k3 (nats/token)"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.9))
    facts = {}
    for (loss, rs), color in zip(sorted(losses.items()), _colors(len(losses))):
        facts[loss] = {}
        by_seed = _groups(rs, lambda r: str(r.get("seed")))
        for ax, (name, title) in zip(axes, names):
            xs, ys, hs = [], [], []
            for i, b in enumerate(LAG_BUCKETS):
                iv = stats.t_interval([v for v in (_bucket_mean(g, b, name)
                                                   for g in by_seed.values()) if v is not None])
                if iv.n:
                    xs.append(i)
                    ys.append(iv.mean)
                    hs.append(iv.half if math.isfinite(iv.half) else 0.0)
            facts[loss][name] = {LAG_BUCKETS[i]: {"mean": y, "ci95_half": h}
                                 for i, y, h in zip(xs, ys, hs)}
            ax.errorbar(xs, ys, yerr=hs, color=color, marker="o", ms=4, lw=1.3, capsize=2,
                        label=loss)
    seeds = max(len(_groups(rs, lambda r: str(r.get("seed")))) for rs in losses.values())
    for ax, (name, title) in zip(axes, names):
        ax.set_xticks(range(len(LAG_BUCKETS)), LAG_BUCKETS)
        ax.set(xlabel="lag bucket (versions)", title=f"{title}: mean, 95% t ({seeds} seeds)")
        ax.grid(alpha=0.3)
    axes[2].set_yscale("symlog", linthresh=1e-3)
    axes[2].set_ylim(bottom=0)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return {"path": _save(fig, out, "diagnostics_by_lag"), "losses": facts}


def kv_policy(runs: Sequence[Run], out: str) -> dict:
    """keep vs recompute at matched max_lag (async, no injection): final held-out accuracy,
    mean token lag vs mean KV lag, and learner steps per minute."""
    runs = _swept([r for r in runs if not _injected(r) and r.get("mode") == "async" and r.evals],
                  "kv_policy")
    lags = sorted({r.get("max_lag") for r in runs
                   if {"keep", "recompute"} <= {q.get("engine.kv_policy") for q in runs
                                                if q.get("max_lag") == r.get("max_lag")}})
    if not lags:
        raise Skip("needs async runs with kv_policy keep and recompute at the same max_lag "
                   "(configs/ablate/kv_policy.py)")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    facts = {}
    width = 0.38
    for j, (policy, color) in enumerate((("keep", "C0"), ("recompute", "C1"))):
        stats = {"acc": [], "lag": [], "kv_lag": [], "speed": []}
        for m in lags:
            rs = [r for r in runs if r.get("max_lag") == m and r.get("engine.kv_policy") == policy]
            stats["acc"].append(_cell_stats(rs, lambda r: r.evals[-1][2]))
            stats["lag"].append(_cell_stats(rs, lambda r: _mean_metric(r, "lag/mean")))
            stats["kv_lag"].append(_cell_stats(rs, lambda r: _mean_metric(r, "kv_lag/mean")))
            stats["speed"].append(_cell_stats(
                rs, lambda r: 60 * r.rows[-1]["step"] / r.rows[-1]["wall_time_s"]))
        x = np.arange(len(lags)) + (j - 0.5) * width
        axes[0].bar(x, [a[0] for a in stats["acc"]], width, yerr=[a[1] for a in stats["acc"]],
                    color=color, label=policy, capsize=2)
        axes[1].bar(x, [a[0] for a in stats["kv_lag"]], width, color=color, alpha=0.9,
                    label=f"{policy}: KV lag")
        axes[1].plot(x, [a[0] for a in stats["lag"]], "k_", ms=14, mew=2,
                     label="token lag" if j == 0 else None)
        axes[2].bar(x, [a[0] for a in stats["speed"]], width, color=color, label=policy)
        facts[policy] = {str(m): {"final_eval_accuracy": a[0], "lag_mean": lg[0],
                                  "kv_lag_mean": kv[0], "steps_per_min": sp[0]}
                         for m, a, lg, kv, sp in zip(lags, stats["acc"], stats["lag"],
                                                     stats["kv_lag"], stats["speed"])}
    for ax, title in zip(axes, ("final held-out accuracy", "mean lag of trained tokens",
                                "learner steps per minute")):
        ax.set_xticks(range(len(lags)), [f"max_lag={m}" for m in lags])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return {"path": _save(fig, out, "kv_policy"), **facts}


def _engine_series(r: Run):
    """(t, occupancy) from engine_stats.jsonl, t from when the sampler first held weights."""
    rows = read_jsonl(os.path.join(r.path, "engine_stats.jsonl"))
    rows = [x for x in rows if isinstance(x.get("occupancy"), (int, float))
            and isinstance(x.get("time_s"), (int, float))]
    live = [x for x in rows if x.get("version", -1) >= 0]
    if not live:
        return np.zeros(0), np.zeros(0)
    t0 = live[0]["time_s"]
    return (np.asarray([x["time_s"] - t0 for x in live]),
            np.asarray([x["occupancy"] for x in live]))


def _learner_idle_series(r: Run):
    """(t, idle fraction) per learner step: 1 - (train + weight sync) / time since the previous
    step; t from when the learner first asked for a batch."""
    s, t, _ = r.series("learner/step_time_s")
    if t.size < 2:
        return np.zeros(0), np.zeros(0)
    rows = {x["step"]: x for x in r.rows}
    first = rows[s[0]]
    t0 = t[0] - first.get("learner/wait_time_s", 0) - first["learner/step_time_s"] \
        - first.get("weight_sync/time_s", 0)
    busy = np.asarray([rows[k]["learner/step_time_s"] + rows[k].get("weight_sync/time_s", 0)
                       for k in s[1:]])
    dt = np.diff(t)
    return t[1:] - t0, np.clip(1 - busy / np.maximum(dt, 1e-9), 0, 1)


def occupancy_vs_sim(runs: Sequence[Run], out: str) -> dict:
    """Sampler slot occupancy and learner idle fraction over time for one sync and one async
    run (the async one with the largest max_lag), measured (thin: raw, thick: 10 s mean)
    beside the simulator calibrated from that run's own logs (`sim.calibrate`)."""
    from pipelinerl_jax.sim import plots as sim_plots  # --sim figures only
    from pipelinerl_jax.sim.calibrate import (calibrated_setup, embedded_cpu_base,  # --sim only
                                              read_run)
    from pipelinerl_jax.sim.pipeline import simulate  # --sim only
    cands = []  # runs with raw logs: run directories, or tables' raw/<name> (export_raw)
    for r in runs:
        d = raw_dir(r) if not _injected(r) and r.get("engine.kv_policy", "keep") == "keep" \
            else None
        if d is not None:
            cands.append(r if d == r.path else load_run(d))
    sync = [r for r in cands if r.get("mode") == "sync"]
    asyn = sorted([r for r in cands if r.get("mode") == "async"], key=lambda r: -r.get("max_lag", 0))
    if not sync or not asyn:
        raise Skip("needs a sync and an async run without lag injection, with engine_stats.jsonl "
                   "(a run directory, or committed tables' raw/<run>: export_results --raw_run)")
    base = embedded_cpu_base(128, series_dt_s=0.5)
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex="col")
    facts = {}
    for row, r in enumerate((sync[0], asyn[0])):
        label = _schedule_label(r)
        try:
            m = read_run(r.path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise Skip(f"{r.path}: the simulator cannot calibrate from it ({e})") from None
        pred = simulate(calibrated_setup(m, base))
        rates = sim_plots.rates(pred)
        summ = pred.summary()
        et, occ = _engine_series(r)
        lt, idle = _learner_idle_series(r)
        span = max(et[-1] if et.size else 0, lt[-1] if lt.size else 0)
        sel = rates["t"] <= span
        st = rates["t"][sel]
        nb = max(int(10 / base.series_dt_s), 1)
        ax = axes[row, 0]
        ax.plot(et, occ, color="C0", lw=0.6, alpha=0.35)
        ax.plot(et, _smooth(occ, 10), color="C0", lw=1.8, label="measured")
        ax.plot(st, _smooth(rates["occupancy"][sel], nb), color="C3", lw=1.5, ls="--",
                label="simulator (calibrated)")
        ax.set(ylabel="sampler slot occupancy", ylim=(0, 1.02), title=f"{label}: sampler")
        ax = axes[row, 1]
        ax.plot(lt, idle, color="C0", lw=0.6, alpha=0.35)
        ax.plot(lt, _smooth(idle, 5), color="C0", lw=1.8, label="measured")
        ax.plot(st, 1 - _smooth(rates["learner_busy"][sel], nb), color="C3", lw=1.5, ls="--",
                label="simulator (calibrated)")
        ax.set(ylabel="learner idle fraction", ylim=(0, 1.02), title=f"{label}: learner")
        facts[label] = {"run": r.name,
                        "measured": {"sampler_occupancy": m.measured["sampler_occupancy"],
                                     "learner_idle_fraction": m.measured["learner_idle_fraction"]},
                        "predicted": {"sampler_occupancy": summ["sampler_occupancy"],
                                      "learner_idle_fraction": summ["learner_idle_fraction"]}}
        for col, key in ((0, "sampler_occupancy"), (1, "learner_idle_fraction")):
            axes[row, col].text(0.98, 0.04, f"mean: measured {facts[label]['measured'][key]:.2f}"
                                f", simulated {facts[label]['predicted'][key]:.2f}",
                                transform=axes[row, col].transAxes, ha="right", fontsize=8,
                                bbox=dict(boxstyle="round", fc="white", alpha=0.8))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("seconds since sampling started")
    axes[0, 0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return {"path": _save(fig, out, "occupancy_vs_sim"), **facts}


def _task_target_lengths(cfg: dict, n: int = 5000) -> Optional[np.ndarray]:
    """Token lengths (EOS included) of the reference answers of `n` problems of the run's
    task, or None when the run's config cannot rebuild its task."""
    try:
        from pipelinerl_jax.tasks import get_task, task_config  # lengths figure only
        from pipelinerl_jax.tokenizer import get_tokenizer, tokenizer_config  # lengths figure only
        tc = task_config(cfg["task"]["name"])
        tc.update(cfg["task"])
        kc = tokenizer_config()
        kc.update(cfg.get("tokenizer", {}))
        task, tok = get_task(tc), get_tokenizer(kc)
        probs = task.problems(seed=0)
        return np.asarray([len(tok.encode_completion(next(probs).answer)) for _ in range(n)])
    except Exception:  # noqa: BLE001 - a partial or foreign config: draw the samples alone
        return None


def lengths_and_lag(runs: Sequence[Run], out: str, max_samples: int = 200_000) -> dict:
    """Left: the response-length distribution of the task (every sample the workers scored,
    pooled over the runs without lag injection, or all runs if none), with its median and
    p99. Right: the fraction of trained tokens at each lag (summed `lag/hist`) per schedule."""
    pool = _swept([r for r in runs if not _injected(r)], "schedule") or list(runs)
    counts: Dict[int, int] = {}
    for r in pool:
        for k, c in response_lengths(r).items():
            counts[k] = counts.get(k, 0) + c
        if sum(counts.values()) >= max_samples:
            break
    lengths = np.repeat(np.asarray(sorted(counts), int),
                        [counts[k] for k in sorted(counts)]).tolist()
    hists = {}
    scheduled = _swept([r for r in runs if not _injected(r)], "schedule")
    for r in scheduled or runs:  # injected runs only when there is nothing else to show
        h = lag_hist(r)
        if h.sum() > 0:
            label = _schedule_label(r) if scheduled else f"injected k={r.get('lag_injection.k')}"
            old = hists.get(label, np.zeros(0))
            n = max(old.size, h.size)
            hists[label] = np.pad(old, (0, n - old.size)) + np.pad(h, (0, n - h.size))
    if not lengths and not hists:
        raise Skip("needs samples*.jsonl or lag/hist in the runs")
    fig, (ax_l, ax_h) = plt.subplots(1, 2, figsize=(11, 3.8))
    facts = {}
    target = _task_target_lengths(pool[0].config) if pool else None
    if lengths:
        x = np.asarray(lengths)
        med, p99 = float(np.median(x)), float(np.quantile(x, 0.99))
        top = max(x.max(), target.max() if target is not None else 0)
        bins = np.arange(0, top + 2) - 0.5
        ax_l.hist(x, bins=bins, color="C0", alpha=0.8, label="sampled responses")
        if target is not None:  # the task's reference answers, scaled to the same count
            ax_l.hist(target, bins=bins, histtype="step", color="k", lw=1,
                      weights=np.full(target.size, x.size / target.size),
                      label="task's reference answers")
            facts["task_reference"] = {"median": float(np.median(target)),
                                       "p99": float(np.quantile(target, 0.99))}
        ax_l.axvline(med, color="C1", ls="--", lw=1, label=f"median {med:.0f}")
        ax_l.axvline(p99, color="C3", ls="--", lw=1, label=f"p99 {p99:.0f}")
        ax_l.set(yscale="log", xlabel="response length (tokens)", ylabel="samples",
                 title=f"response lengths ({x.size:,} samples)")
        ax_l.legend(fontsize=8)
        facts["lengths"] = {"samples": int(x.size), "median": med, "p99": p99,
                            "max": int(x.max()), "mean": float(x.mean())}
    if hists:
        labels = sorted(hists, key=_schedule_order if scheduled else _injected_order)
        width = 0.8 / len(labels)
        facts["token_lag"] = {}
        for i, (label, color) in enumerate(zip(labels, _colors(len(labels)))):
            h = hists[label] / hists[label].sum()
            ax_h.bar(np.arange(h.size) + (i - (len(labels) - 1) / 2) * width, h, width,
                     color=color, label=label)
            facts["token_lag"][label] = {"mean": float((np.arange(h.size) * h).sum()),
                                         "fractions": [float(v) for v in h]}
        ax_h.set(xlabel="lag of a trained token (versions)", ylabel="fraction of tokens",
                 title="per-token lag at train time")
        ax_h.legend(fontsize=8)
    for ax in (ax_l, ax_h):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return {"path": _save(fig, out, "lengths_and_lag"), **facts}


FIGURES = {"sync_vs_async": sync_vs_async, "lag_ablation": lag_ablation,
           "diagnostics_by_lag": diagnostics_by_lag, **study_figures.FIGURES,
           "kv_policy": kv_policy, "occupancy_vs_sim": occupancy_vs_sim,
           "lengths_and_lag": lengths_and_lag}


def make_all(roots: Sequence[str], out: str, only: Sequence[str] = (),
             target_accuracy: Optional[float] = None, log=print) -> dict:
    """Draws every figure (or `only` those) it can from the runs under `roots`.

    Returns {"figures": {name: facts | {"skipped": reason}}, "problems": [...]}; the
    problems (missing or malformed run directories) are printed by name."""
    runs, problems = load_runs(roots)
    for p in problems:
        log(f"skipped: {p}")
    if target_accuracy is None:  # a grid's own target (analysis.target_accuracy), if any
        for root in roots:
            try:
                with open(os.path.join(root, "ablation.json")) as f:
                    target_accuracy = json.load(f)["analysis"]["target_accuracy"]
                break
            except (OSError, ValueError, KeyError, TypeError):
                continue
    results = {}
    for name, fn in FIGURES.items():
        if only and name not in only:
            continue
        try:
            kw = {"target": target_accuracy} if name == "sync_vs_async" else {}
            results[name] = fn(runs, out, **kw)
            log(f"{name}: {results[name]['path']}")
        except Skip as e:
            results[name] = {"skipped": str(e)}
            log(f"{name}: skipped ({e})")
    return {"figures": results, "problems": problems, "runs": len(runs)}
