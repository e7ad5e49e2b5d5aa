"""The protocol's `async` grid read as a study (docs/staleness_study.md, Protocol; the analysis
stated 2026-12-06, before any of the grid's results was read).

    grids = async_grids(runs)                 # {lr: {arm: {bound: {seed: run}}}}
    fams = families(grids[lr], arms)          # the cost of asynchrony, the contrast with PPO-clip
    print(section_markdown(grids[lr], fams, lr))

The runs are real asynchronous pipeline runs (`mode=async`, no lag injection): the
pipeline's timing sets each token's lag, under the bound `max_lag`. So the grid is keyed by
that bound, an input set before the run; the lags the runs trained on are an outcome, and
are reported as one (`realized_lag`). The synchronous reference of an arm is its in-process
run at injected lag 0 with the same label, learning rate and seed (the `mb4` grid's: same
warm start, minibatches and rate; the in-process mode takes the pipeline's trained batches,
docs/staleness_study.md), keyed by bound 0 when those runs are given too.

On the primary endpoint (final held-out accuracy), seed-paired, Holm within each family:
  cost of asynchrony   each arm at each bound against its synchronous run (the mb4 lag-0
                       cell; absent without it);
  vs PPO-clip          each arm against PPO-clip at the same bound.
Secondary: each arm at its largest bound against its smallest; every pair of arms at each
bound; and the realized lag's balance (each arm's mean trained-token lag against PPO-clip's,
seed-paired): an arm whose runs trained on staler tokens than PPO-clip's under the same bound
is compared at a different lag, not only with a different loss.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.ablation import protocol, stats
from pipelinerl_jax.ablation.results import Run, lag_hist, stalest_diagnostics, summarize_run
from pipelinerl_jax.ablation.staleness import (Grid, by_learning_rate, final_accuracy,
                                              learning_rate, loss_label, put, sync_label,
                                              with_sync_reference)

SYNC = 0  # the bound of the synchronous reference (on-policy: every token at lag 0)


def is_async(r: Run) -> bool:
    """A real asynchronous run (no injection) with evaluations."""
    return (not r.get("lag_injection.enabled", False) and r.get("mode") == "async"
            and r.get("max_lag") is not None and bool(r.evals))


def arm_label(r: Run) -> str:
    """The run's loss label with its other grid axes but the bound (`ppo (minibatches=4)`):
    the label of the arm's synchronous run in the lag-injected grids."""
    return sync_label(loss_label(r))


def async_grids(runs: Sequence[Run]) -> Dict[float, Grid]:
    """{learning rate: {arm: {max_lag: {seed: run}}}} of the asynchronous runs, with each
    arm's synchronous reference (in-process runs of the same label at injected lag 0) under
    bound 0 where the runs hold it."""
    out: Dict[float, Grid] = {}
    for r in runs:
        if is_async(r):
            put(out.setdefault(learning_rate(r), {}), arm_label(r), int(r.get("max_lag")), r,
                "bound")
    injected = by_learning_rate(runs)
    return {lr: with_sync_reference(out[lr], injected.get(lr, {})) for lr in sorted(out)}


def bounds(grid: Grid) -> List[int]:
    """The asynchronous bounds present (not the synchronous reference)."""
    return sorted({k for cells in grid.values() for k in cells if k != SYNC})


def families(grid: Grid, arms: Sequence[str], reference: str = protocol.REFERENCE_ARM,
             fn=final_accuracy) -> dict:
    """The two families (Holm within each) and the secondary comparisons, on `fn`."""
    base = {a.split(" (")[0]: a for a in grid}
    present = [base[a] for a in arms if a in base]
    ref = base.get(reference, reference)
    ks = bounds(grid)
    out = {"cost of asynchrony": protocol.staleness_cost(grid, fn, present, ks),
           "vs PPO-clip": protocol.versus_reference(grid, fn, present, ks, ref)}
    if len(ks) > 1:
        out["largest vs smallest bound"] = protocol.between_lags(
            grid, fn, present, ks[-1], ks[0], "largest vs smallest bound")
    for k in ks:
        out[f"all pairs at bound {k}"] = protocol.all_pairs(
            {a: {k: c[k]} for a, c in grid.items() if k in c}, fn, k)
    return out


def pooled_lag_hist(runs) -> np.ndarray:
    """Trained tokens per lag, summed over `runs` (results.lag_hist of each)."""
    hists = [lag_hist(r) for r in runs]
    out = np.zeros(max((h.size for h in hists), default=0))
    for h in hists:
        out[: h.size] += h
    return out


def realized_lag(r: Run) -> Dict[str, Optional[float]]:
    """The lags a run trained on (an outcome): the token-weighted mean, the share at lag 0,
    the largest lag holding tokens (`lag/hist` summed over the steps)."""
    h = lag_hist(r)
    n = float(h.sum()) if h.size else 0.0
    if not n:
        return {"mean": None, "at0": None, "max": None}
    return {"mean": float((np.arange(h.size) * h).sum() / n), "at0": float(h[0] / n),
            "max": float(np.nonzero(h)[0][-1])}


def mean_lag(r: Run) -> Optional[float]:
    return realized_lag(r)["mean"]


def lag_balance(grid: Grid, reference: str = protocol.REFERENCE_ARM) -> List[dict]:
    """Each arm's mean trained-token lag against PPO-clip's at the same bound, seed-paired."""
    base = {a.split(" (")[0]: a for a in grid}
    ref = base.get(reference)
    rows = []
    for k in bounds(grid):
        for a in sorted(grid):
            if ref is None or a == ref or k not in grid[a] or k not in grid[ref]:
                continue
            c = stats.compare({s: mean_lag(r) for s, r in grid[a][k].items()},
                              {s: mean_lag(r) for s, r in grid[ref][k].items()})
            rows.append({"a": a, "b": ref, "bound": k, "n": c.n, "diff": c.diff,
                         "half": c.half, "verdict": c.verdict})
    return rows


def outcome_table(grid: Grid) -> List[dict]:
    """Per arm and bound: accuracy with its interval, the realized lag, the stalest bucket's
    KL and clip fraction, steps per minute (means over seeds), and collapsed runs."""
    rows = []
    for a in sorted(grid):
        for k in sorted(grid[a]):
            runs = list(grid[a][k].values())
            acc = stats.t_interval([v for v in map(final_accuracy, runs) if v is not None])
            lags = [realized_lag(r) for r in runs]
            diag = [stalest_diagnostics(r) for r in runs]
            summ = [summarize_run(r, None) for r in runs]

            def mean(vals):
                vals = [v for v in vals if v is not None and math.isfinite(v)]
                return float(np.mean(vals)) if vals else None
            rows.append({
                "arm": a, "bound": k, "n": acc.n, "acc": acc.mean, "half": acc.half,
                "lag_mean": mean([x["mean"] for x in lags]),
                "lag_mean_sd": (float(np.std([x["mean"] for x in lags if x["mean"] is not None],
                                             ddof=1)) if sum(x["mean"] is not None
                                                             for x in lags) > 1 else None),
                "at_lag0": mean([x["at0"] for x in lags]),
                "lag_max": max((x["max"] for x in lags if x["max"] is not None), default=None),
                "kl_stalest": mean([d["kl_k3_stalest"] for d in diag]),
                "clip_stalest": mean([d["clip_frac_stalest"] for d in diag]),
                "steps_per_min": mean([s["steps_per_min"] for s in summ]),
                "collapsed": sum(bool(s["collapsed"]) for s in summ)})
    return rows


def _num(v, fmt: str, scale: float = 1.0) -> str:
    return "" if v is None or not math.isfinite(v) else format(v * scale, fmt)


def section_markdown(grid: Grid, fams: dict, lr: float, scale: float = 100.0) -> str:
    """The grid's section of the report: the families, then the secondary comparisons and
    the outcomes, labelled so."""
    ks = bounds(grid)
    sync = any(SYNC in c for c in grid.values())
    out = [f"## Real asynchronous runs (the `async` grid), learning rate {lr:g}", "",
           f"Bounds (max_lag, set before the run): {', '.join(map(str, ks))}; '@ 0' is the "
           "arm's synchronous in-process run at lag 0 (same seed, warm start, rate and "
           "minibatches)" + ("" if sync else " — not among the runs given: pass the `mb4` "
                             "tables too for the cost of asynchrony") + ". '@ k' of an "
           "asynchronous arm is its bound, not the lag its tokens had (below). Primary "
           "endpoint, final held-out accuracy; Holm within each family, 5% two-sided.", "",
           "### Family A1: the cost of asynchrony (each arm at bound k vs its synchronous run)",
           "", protocol.family_markdown(fams["cost of asynchrony"], scale), "",
           "### Family A2: each arm vs PPO-clip at the same bound", "",
           protocol.family_markdown(fams["vs PPO-clip"], scale), "",
           "### Secondary: each arm at its largest bound vs its smallest", "",
           protocol.family_markdown(fams.get("largest vs smallest bound", []), scale), ""]
    for k in ks:
        out += [f"### Secondary: every pair of arms at bound {k}", "",
                protocol.family_markdown(fams[f"all pairs at bound {k}"], scale), ""]
    out += ["### Outcomes of the runs (not inputs): the lags they trained on, drift, speed", "",
            "| arm | bound | seeds | final acc (%) | mean token lag (SD over seeds) | "
            "share at lag 0 | largest lag | KL k3 stalest | clip stalest | steps/min | "
            "collapsed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in outcome_table(grid):
        acc = stats.Interval(r["acc"], r["half"], r["n"]).text(scale) if r["n"] else ""
        sd = f" ({_num(r['lag_mean_sd'], '.2f')})" if r["lag_mean_sd"] is not None else ""
        out.append(f"| {r['arm']} | {r['bound']} | {r['n']} | {acc} | "
                   f"{_num(r['lag_mean'], '.2f')}{sd} | {_num(r['at_lag0'], '.2f')} | "
                   f"{_num(r['lag_max'], '.0f')} | {_num(r['kl_stalest'], '.3f')} | "
                   f"{_num(r['clip_stalest'], '.3f')} | {_num(r['steps_per_min'], '.1f')} | "
                   f"{r['collapsed']}/{r['n']} |")
    out += ["", "### Secondary: is the realized lag balanced across arms? (each arm's mean "
            "token lag vs PPO-clip's at the same bound, seed-paired)", "",
            "| arm | vs | bound | seeds | difference (versions) | 95% CI | verdict |",
            "|---|---|---|---|---|---|---|"]
    for r in lag_balance(grid):
        ci = (f"[{r['diff'] - r['half']:+.2f}, {r['diff'] + r['half']:+.2f}]"
              if math.isfinite(r["half"]) else "")
        out.append(f"| {r['a']} | {r['b']} | {r['bound']} | {r['n']} | {r['diff']:+.2f} | "
                   f"{ci} | {'differs' if r['verdict'] in ('better', 'worse') else r['verdict']}"
                   " |")
    out += ["", "An arm whose tokens were significantly staler (or fresher) than PPO-clip's "
            "under the same bound is compared with it at a different lag, not only with a "
            "different loss: read its A2 row with that difference.", ""]
    return "\n".join(out)


def figure(grid: Grid, out: str, lr: float) -> str:
    """async_bounds.png: final held-out accuracy (mean, 95% t-interval over seeds) against
    the bound, the synchronous run at 0 (left); the share of trained tokens at each lag,
    pooled over seeds, per arm and bound (right: the lags the bound let through)."""
    from pipelinerl_jax.ablation.plotting import colors, plt, save
    fig, (ax, ax_lag) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = sorted({k for c in grid.values() for k in c})
    xpos = {k: i for i, k in enumerate(ks)}
    styles = ("-", "--", ":")
    for i, (arm, color) in enumerate(zip(sorted(grid), colors(len(grid)))):
        cells = grid[arm]
        ivs = {k: stats.t_interval([v for v in map(final_accuracy, cells[k].values())
                                    if v is not None]) for k in sorted(cells)}
        x = np.asarray([xpos[k] for k in ivs], float) + (i - len(grid) / 2) * 0.04
        ax.errorbar(x, [iv.mean for iv in ivs.values()],
                    yerr=[iv.half if math.isfinite(iv.half) else 0 for iv in ivs.values()],
                    color=color, marker="o", ms=4, lw=1.4, capsize=2, label=arm)
        for k, ls in zip(bounds(grid), styles):
            if k not in cells:
                continue
            hist = pooled_lag_hist(cells[k].values())
            if hist.sum():
                ax_lag.plot(np.arange(hist.size), hist / hist.sum(), ls, color=color,
                            marker=".", label=f"{arm}, max_lag {k}")
    ax.set_xticks(range(len(ks)), ["sync" if k == SYNC else str(k) for k in ks])
    ax.set(xlabel="max_lag (the bound set before the run)",
           ylabel="final held-out greedy accuracy",
           title=f"real asynchronous runs, lr {lr:g} (mean, 95% t-interval)")
    ax_lag.set(xlabel="lag of a trained token (versions)", ylabel="share of trained tokens",
               title="the lags the runs trained on (an outcome)")
    for a in (ax, ax_lag):
        a.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax_lag.legend(fontsize=6)
    fig.tight_layout()
    return save(fig, out, "async_bounds")
