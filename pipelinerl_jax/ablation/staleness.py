"""The staleness grid read as a study: loss x injected lag cells with 95% intervals over seeds,
significance against each loss's lag-0 cell, and whether ESS predicts the accuracy drop.

    runs, _ = results.load_runs(["results/staleness"])     # run dirs or committed tables
    grid = lag_grid(runs)                                  # {loss: {lag: {seed: Run}}}
    print(accuracy_markdown(grid))                         # "mean ± half", bold = differs
    ess = ess_analysis(grid)                               # per loss + across all cells

A cell's runs share the warm start and differ by seed; seeds are the replicates (stats.py).
"Significantly below lag 0": the paired-by-seed 95% t-interval of (cell - lag-0 cell) of the
final held-out accuracy lies below 0. The ESS of a run is the token-weighted mean ESS of its
stalest lag bucket (results.stalest_diagnostics); a cell's ESS is the mean over its seeds.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.ablation import stats
from pipelinerl_jax.ablation.results import Run, stalest_diagnostics

ESS_THRESHOLD = 0.5

Grid = Dict[str, Dict[int, Dict[int, Run]]]


def loss_label(r: Run) -> str:
    """The run's loss label, with any other grid axis it sits on (e.g. `ppo (minibatches=4)`):
    runs of another grid that share a loss label but not its settings (the decoupled-PPO
    repro's 4-minibatch, lr 5e-5 ppo) must not pool with, or replace, the staleness grid's."""
    base = r.labels.get("loss") or str(r.get("loss.name", "?"))
    extra = [f"{k}={v}" for k, v in sorted(r.labels.items()) if k not in ("loss", "lag", "seed")]
    return f"{base} ({', '.join(extra)})" if extra else base


def seed_of(r: Run) -> int:
    s = r.get("seed")
    return int(s) if s is not None else int(r.labels.get("seed", 0))


def lag_grid(runs: Sequence[Run], key=loss_label) -> Grid:
    """{loss label: {injected lag: {seed: run}}} of the lag-injected runs with evaluations
    (a later run of the same loss, lag and seed replaces an earlier one)."""
    grid: Grid = {}
    for r in runs:
        if not r.get("lag_injection.enabled", False) or not r.evals:
            continue
        grid.setdefault(key(r), {}).setdefault(int(r.get("lag_injection.k", 0)), {})[
            seed_of(r)] = r
    return grid


def final_accuracy(r: Run) -> Optional[float]:
    return r.evals[-1][2] if r.evals else None


def ess_stalest(r: Run) -> Optional[float]:
    return stalest_diagnostics(r)["ess_stalest"]


def per_seed(cell: Dict[int, Run], fn) -> Dict[int, Optional[float]]:
    return {s: fn(r) for s, r in cell.items()}


def cell_interval(cell: Dict[int, Run], fn=final_accuracy) -> stats.Interval:
    return stats.t_interval([v for v in per_seed(cell, fn).values() if v is not None])


def versus(cell: Dict[int, Run], ref: Dict[int, Run], fn=final_accuracy,
           higher_is_better: bool = True) -> stats.Comparison:
    """cell vs ref (e.g. the same loss at lag 0, or ppo at the same lag), paired by seed."""
    return stats.compare(per_seed(cell, fn), per_seed(ref, fn),
                         higher_is_better=higher_is_better)


def _order(grid: Grid) -> List[str]:
    # The registry's order when the labels are loss names, else alphabetical.
    try:
        from pipelinerl_jax.losses import LOSSES  # jax import: only for the ordering
        rank = {n: i for i, n in enumerate(LOSSES)}
    except ImportError:  # pragma: no cover
        rank = {}
    return sorted(grid, key=lambda n: (rank.get(n, len(rank)), n))


def accuracy_table(grid: Grid, fn=final_accuracy) -> List[dict]:
    """One row per (loss, lag): the interval and the comparison with that loss's lag 0."""
    rows = []
    for loss in _order(grid):
        ref = grid[loss].get(0)
        for lag in sorted(grid[loss]):
            cell = grid[loss][lag]
            iv = cell_interval(cell, fn)
            cmp = versus(cell, ref, fn) if ref is not None and lag != 0 else None
            rows.append({"loss": loss, "lag": lag, "n": iv.n, "mean": iv.mean, "half": iv.half,
                         "lo": iv.lo, "hi": iv.hi,
                         "diff_vs_lag0": cmp.diff if cmp else None,
                         "diff_half": cmp.half if cmp else None,
                         "vs_lag0": cmp.verdict if cmp else None})
    return rows


def accuracy_markdown(grid: Grid, fn=final_accuracy, scale: float = 100.0) -> str:
    """Markdown: loss x lag, 'mean ± half-width' (95% t over seeds, percent), in bold with an
    arrow where the cell differs significantly from the loss's lag-0 cell."""
    lags = sorted({k for cells in grid.values() for k in cells})
    rows = {(r["loss"], r["lag"]): r for r in accuracy_table(grid, fn)}
    seeds = sorted({r["n"] for r in rows.values()})
    out = ["| loss | " + " | ".join(f"lag {k}" for k in lags) + " |",
           "|---|" + "---|" * len(lags)]
    for loss in _order(grid):
        cells = []
        for k in lags:
            r = rows.get((loss, k))
            if r is None or r["n"] == 0:
                cells.append("")
                continue
            text = stats.Interval(r["mean"], r["half"], r["n"]).text(scale)
            if r["vs_lag0"] in ("better", "worse"):
                text = f"**{text}** {'↑' if r['vs_lag0'] == 'better' else '↓'}"
            cells.append(text)
        out.append(f"| {loss} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"Final held-out accuracy (%), mean ± half-width of the 95% Student-t interval "
               f"over seeds (n = {'/'.join(map(str, seeds))} per cell, n-1 df). **Bold** ↓/↑: "
               f"the paired-by-seed 95% interval of the difference to the same loss at lag 0 "
               f"excludes 0.")
    return "\n".join(out)


def _first(lags: Sequence[int], pred) -> Optional[int]:
    return next((k for k in lags if pred(k)), None)


def ess_analysis(grid: Grid, threshold: float = ESS_THRESHOLD) -> dict:
    """Per loss: the ESS of the stalest bucket per lag, the smallest lag whose cell-mean ESS
    is below `threshold`, the smallest lag whose accuracy is significantly below lag 0. Over
    every cell with lag > 0 (and a lag-0 reference): how well 'ESS < threshold' classifies
    'significant drop' (confusion counts, accuracy) and the Pearson / Spearman correlation
    of the cell's ESS with its accuracy difference to lag 0."""
    per_loss, cells = {}, []
    for loss in _order(grid):
        by_lag, ref = grid[loss], grid[loss].get(0)
        lags = sorted(by_lag)
        ess = {k: cell_interval(by_lag[k], ess_stalest) for k in lags}
        drop = {k: versus(by_lag[k], ref) for k in lags if k and ref is not None}
        per_loss[loss] = {
            "ess": {k: (iv.mean, iv.half, iv.n) for k, iv in ess.items()},
            "ess_below_lag": _first(lags, lambda k: ess[k].n and ess[k].mean < threshold),
            "drop_lag": _first(lags, lambda k: k in drop and drop[k].verdict == "worse"),
            "accuracy_diff": {k: (c.diff, c.half, c.verdict) for k, c in drop.items()}}
        for k, c in drop.items():
            if ess[k].n and c.verdict != "n/a":
                cells.append({"loss": loss, "lag": k, "ess": ess[k].mean, "diff": c.diff,
                              "half": c.half, "predicted": ess[k].mean < threshold,
                              "dropped": c.verdict == "worse"})
    out = {"threshold": threshold, "losses": per_loss, "cells": cells}
    if cells:
        tp = sum(c["predicted"] and c["dropped"] for c in cells)
        fp = sum(c["predicted"] and not c["dropped"] for c in cells)
        fn = sum(not c["predicted"] and c["dropped"] for c in cells)
        tn = len(cells) - tp - fp - fn
        out["classifier"] = {"cells": len(cells), "tp": tp, "fp": fp, "fn": fn, "tn": tn,
                             "accuracy": (tp + tn) / len(cells),
                             "precision": tp / (tp + fp) if tp + fp else None,
                             "recall": tp / (tp + fn) if tp + fn else None}
        x = np.asarray([c["ess"] for c in cells])
        y = np.asarray([c["diff"] for c in cells])
        out["pearson"] = _corr(x, y)
        out["spearman"] = _corr(_ranks(x), _ranks(y))
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(x.size, dtype=float)
    for v in np.unique(x):
        tie = x == v
        ranks[tie] = ranks[tie].mean()
    return ranks


def _corr(x: np.ndarray, y: np.ndarray) -> Optional[float]:
    if x.size < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def _lag_text(k: Optional[int], lags: Sequence[int]) -> str:
    return str(k) if k is not None else f"none ≤ {max(lags)}"


def ess_markdown(analysis: dict) -> str:
    """Markdown: per loss, the lag where stalest-bucket ESS < threshold and the lag where the
    accuracy drop is significant; then the across-cell classifier and correlations."""
    t = analysis["threshold"]
    out = [f"| loss | ESS of stalest bucket by lag | first lag ESS < {t:g} | first lag "
           f"accuracy significantly below lag 0 | ESS predicted it |", "|---|---|---|---|---|"]
    for loss, a in analysis["losses"].items():
        lags = sorted(a["ess"])
        ess = ", ".join(f"{k}: {m:.2f}" for k, (m, _, n) in a["ess"].items() if n)
        e, d = a["ess_below_lag"], a["drop_lag"]
        agree = "yes (neither)" if e is None and d is None else "yes" if e == d else (
            "early" if e is not None and (d is None or e < d) else "late")
        out.append(f"| {loss} | {ess} | {_lag_text(e, lags)} | {_lag_text(d, lags)} | "
                   f"{agree} |")
    c = analysis.get("classifier")
    if c:
        def num(v):
            return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"
        out += ["", f"Across {c['cells']} cells with lag > 0: 'ESS < {t:g}' as a classifier of "
                f"'accuracy significantly below lag 0' is right in {c['accuracy']:.0%} "
                f"(true positives {c['tp']}, false positives {c['fp']}, false negatives "
                f"{c['fn']}, true negatives {c['tn']}; precision {num(c['precision'])}, recall "
                f"{num(c['recall'])}). Correlation of cell ESS with the accuracy difference to "
                f"lag 0: Pearson {num(analysis.get('pearson'))}, Spearman "
                f"{num(analysis.get('spearman'))}. 'early': ESS fell below {t:g} at a smaller "
                f"lag than accuracy dropped (or accuracy never did); 'late': the reverse."]
    return "\n".join(out)
