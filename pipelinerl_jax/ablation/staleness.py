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

Reading the grid honestly also takes (`pairwise`, `identical_arms`, `reductions`, `drift`):
every loss-vs-loss comparison at a lag with its paired half-width and minimum detectable
effect, and how many false positives its count implies; arms whose runs are identical number
for number (two names, one update); what a loss reduces to under the grid's settings; and
staleness measured as drift (KL k3 between behaviour and current policy in the stalest
bucket) beside lag, across learning rates.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.ablation import protocol, stats
from pipelinerl_jax.ablation.results import Run, stalest_diagnostics, summarize_run

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
    """{key (the loss label): {injected lag: {seed: run}}} of the lag-injected runs with
    evaluations; runs whose key is None are left out. The same run met twice (a rerun, or its
    directory and its committed table) replaces itself; two differently named runs in one
    slot raise ValueError naming both (a key that fails to tell two settings apart)."""
    grid: Grid = {}
    for r in runs:
        if not r.get("lag_injection.enabled", False) or not r.evals:
            continue
        arm = key(r)
        if arm is None:
            continue
        put(grid, arm, int(r.get("lag_injection.k", 0)), r)
    return grid


def put(grid: Grid, arm: str, lag: int, r: Run, what: str = "lag") -> None:
    """Files `r` in grid[arm][lag][its seed]: the same run met twice replaces itself; another
    run in that slot raises ValueError naming both."""
    cell = grid.setdefault(arm, {}).setdefault(lag, {})
    seed = seed_of(r)
    if seed in cell and cell[seed].name != r.name:
        raise ValueError(f"runs {cell[seed].name!r} ({cell[seed].path}) and {r.name!r} "
                         f"({r.path}) are both arm {arm!r}, {what} {lag}, seed {seed}")
    cell[seed] = r


def learning_rate(r: Run) -> float:
    lr = r.get("learner.optimizer.learning_rate")
    return float(lr) if lr is not None else math.nan


def by_learning_rate(runs: Sequence[Run], key=loss_label) -> Dict[float, Grid]:
    """{learning rate: lag_grid of its runs}, in increasing order of learning rate."""
    lrs: Dict[float, List[Run]] = {}
    for r in runs:
        lrs.setdefault(learning_rate(r), []).append(r)
    out = {lr: lag_grid(rs, key) for lr, rs in sorted(lrs.items())}
    return {lr: g for lr, g in out.items() if g}


def main_arms(grid: Grid) -> Grid:
    """The arms that differ only in their loss: the grid proper. Those whose label carries no
    axis but `lr`, without repro arms of other settings beside them (e.g. `ppo
    (minibatches=4)` in the one-minibatch grid); in a grid run wholly at one other setting
    (the protocol's `mb4`: every arm `X (minibatches=4)`) every arm; none when the arms'
    settings differ and none is plain (there is no one grid to compare within)."""
    def extra(label: str) -> tuple:
        inside = label.partition(" (")[2].rstrip(")")
        return tuple(kv for kv in inside.split(", ") if kv and not kv.startswith("lr="))
    settings = {label: extra(label) for label in grid}
    plain = {label: cells for label, cells in grid.items() if not settings[label]}
    if plain or len(set(settings.values())) != 1:
        return plain
    return dict(grid)


# Grid axes that say how a run's lag arises (the injection's law, the asynchronous bound), not
# what it trains: an arm's synchronous run at lag 0 is the same arm without them.
LAG_SOURCE_AXES = ("injection", "max_lag")


def sync_label(label: str) -> str:
    """The label of the arm's synchronous run: `label` without its LAG_SOURCE_AXES
    (`ppo (injection=uniform, minibatches=4)` -> `ppo (minibatches=4)`)."""
    base, _, inside = label.partition(" (")
    kept = [kv for kv in inside.rstrip(")").split(", ")
            if kv and kv.split("=")[0] not in LAG_SOURCE_AXES]
    return f"{base} ({', '.join(kept)})" if kept else base


def with_sync_reference(grid: Grid, refs: Grid) -> Grid:
    """`grid` with each arm that has no lag-0 cell given, as its lag 0, the lag-0 cell of
    the arm of `refs` (another grid at the same learning rate: same warm start, seeds and
    settings) whose label is its `sync_label` (the protocol's `varlag` arms take `mb4`'s)."""
    out: Grid = {}
    for arm, cells in grid.items():
        ref = refs.get(sync_label(arm), {}).get(0)
        out[arm] = {0: ref, **cells} if ref and 0 not in cells else dict(cells)
    return out


def final_accuracy(r: Run) -> Optional[float]:
    return r.evals[-1][2] if r.evals else None


CURVE_FROM_STEP = 20


def curve_accuracy(r: Run, from_step: int = CURVE_FROM_STEP) -> Optional[float]:
    """The mean held-out accuracy of a run's evaluations at steps >= `from_step` (the level of
    its learning curve over the last two thirds of a 60-step grid run: steps 20, 40, 60). A
    lower-noise companion of the final accuracy: it averages out step-to-step wander, and it
    also counts how fast a run got there."""
    vals = [acc for step, _, acc in r.evals if step >= from_step]
    return float(np.mean(vals)) if vals else None


def rescored_accuracy(paths: Sequence[str]):
    """(fn, eval sizes): `fn(run)` = the run's final checkpoint re-scored on a larger
    held-out set by scripts/staleness_reeval.py (CSV files; run name -> accuracy), None for a
    run they do not hold."""
    import csv
    table, sizes = {}, set()
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                table[row["run"]] = float(row["accuracy"])
                sizes.add(int(row["eval_size"]))
    return (lambda r: table.get(r.name)), sorted(sizes)


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


def collapsed_runs(runs) -> int:
    """How many of `runs` collapsed (results.summarize_run's `collapsed`: a non-finite step,
    a held-out evaluation below half the warm start's, or a diverged run)."""
    return sum(bool(summarize_run(r, None)["collapsed"]) for r in runs)


def collapse_markdown(grid: Grid) -> str:
    """Markdown: loss x lag, the runs that collapsed out of the cell's runs (results.
    summarize_run's `collapsed`: a non-finite step, a held-out evaluation below half the
    warm start's, or a diverged run), and the total."""
    lags = sorted({k for cells in grid.values() for k in cells})
    out = ["| loss | " + " | ".join(f"lag {k}" for k in lags) + " |",
           "|---|" + "---|" * len(lags)]
    total = n = 0
    for loss in _order(grid):
        cells = []
        for k in lags:
            runs = list(grid[loss].get(k, {}).values())
            bad = collapsed_runs(runs)
            total, n = total + bad, n + len(runs)
            cells.append(f"{bad}/{len(runs)}" if runs else "")
        out.append(f"| {loss} | " + " | ".join(cells) + " |")
    out += ["", f"Collapsed runs / runs per cell ({total} of {n}): a run collapsed when a step "
                "was non-finite, a held-out evaluation fell below half the warm start's "
                "accuracy, or it diverged (results.summarize_run)."]
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
    if not any(0 in a["ess"] for a in analysis["losses"].values()):
        return "Not computed: no arm of this grid ran at lag 0, so there is no drop to predict."
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


# ============================================================================ resolution

FINGERPRINT_KEYS = ("eval/accuracy", "reward/mean", "loss/loss", "loss/ess", "loss/clip_frac",
                    "loss/kl_k3", "learner/tokens")


def fingerprint(r: Run) -> tuple:
    """Every step's logged evaluation, reward, loss and diagnostics: two runs with the same
    fingerprint made the same updates (to the 6 significant digits committed tables keep)."""
    def v(x):
        return None if x is None else float(f"{float(x):.6g}")
    return tuple((row.get("step"),) + tuple(v(row.get(k)) for k in FINGERPRINT_KEYS)
                 for row in r.rows)


def identical_arms(grid: Grid) -> List[dict]:
    """Pairs of arms whose runs are identical number for number in (lag, seed) cells they
    share: {a, b, shared, identical, lags} (lags where every shared seed is identical)."""
    out, labels = [], _order(grid)
    prints = {(a, k, s): fingerprint(r) for a in labels for k in grid[a]
              for s, r in grid[a][k].items()}
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            shared = [(k, s) for k in grid[a] for s in grid[a][k] if s in grid[b].get(k, {})]
            same = {(k, s) for k, s in shared if prints[(a, k, s)] == prints[(b, k, s)]}
            if same:
                lags = sorted({k for k, _ in shared
                               if all((k, s) in same for kk, s in shared if kk == k)})
                out.append({"a": a, "b": b, "shared": len(shared), "identical": len(same),
                            "lags": lags})
    return out


def pairwise(grid: Grid, fn=final_accuracy, min_lag: int = 4) -> List[dict]:
    """Every pair of arms at every lag >= min_lag that both ran: the seed-paired difference
    (a - b), its 95% half-width, the SD of the per-seed differences, the minimum detectable
    effect at 80% power (stats.min_detectable_effect), the raw paired-t p and the p Holm-
    adjusted within the lag (the protocol's rule for all pairs at a lag: secondary)."""
    rows, labels = [], _order(grid)
    lags = sorted({k for cells in grid.values() for k in cells if k >= min_lag})
    for k in lags:
        at_lag = []
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                if k not in grid[a] or k not in grid[b]:
                    continue
                pa, pb = per_seed(grid[a][k], fn), per_seed(grid[b][k], fn)
                c = stats.compare(pa, pb)
                if not c.paired:
                    continue
                d = [pa[s] - pb[s] for s in pa
                     if s in pb and pa[s] is not None and pb[s] is not None]
                at_lag.append({"lag": k, "a": a, "b": b, "n": c.n, "diff": c.diff,
                               "half": c.half, "sd": c.sd, "verdict": c.verdict,
                               "mde": stats.min_detectable_effect(c.sd, c.n),
                               "p": protocol.paired_p(d)})
        for r, q in zip(at_lag, protocol.holm([r["p"] for r in at_lag])):
            r["p_holm_lag"] = q
        rows += at_lag
    return rows


def resolution(rows: Sequence[dict], goal: float = 0.05) -> List[dict]:
    """Per lag: comparisons, seeds, pooled SD of the paired differences, median and largest
    half-width and MDE, whether every half-width is <= `goal`, significant pairs and the
    false positives expected from the count alone (5% of it)."""
    out = []
    for k in sorted({r["lag"] for r in rows}):
        rs = [r for r in rows if r["lag"] == k and math.isfinite(r["half"])]
        if not rs:
            continue
        halves = np.asarray([r["half"] for r in rs])
        mdes = np.asarray([r["mde"] for r in rs])
        # seeds each comparison needs for a half-width <= goal at its own SD (an estimate from
        # few seeds: the largest of many such estimates runs high)
        need = np.asarray([stats.seeds_for_half_width(r["sd"], goal) or math.inf for r in rs])
        out.append({"lag": k, "comparisons": len(rs), "seeds": min(r["n"] for r in rs),
                    "seeds_needed_median": _finite(np.median(need)),
                    "seeds_needed_p90": _finite(np.percentile(need, 90, method="higher")),
                    "seeds_needed_max": _finite(need.max()),
                    "pooled_sd": float(np.sqrt(np.mean(np.square([r["sd"] for r in rs])))),
                    "half_median": float(np.median(halves)), "half_max": float(halves.max()),
                    "mde_median": float(np.median(mdes)), "mde_max": float(mdes.max()),
                    "goal": goal, "goal_met": bool(halves.max() <= goal),
                    "significant": sum(r["verdict"] in ("better", "worse") for r in rs),
                    "expected_false_positives": 0.05 * len(rs)})
    return out


def _finite(x) -> Optional[float]:
    """A float, or None where it is not finite (JSON has no infinity)."""
    return float(x) if math.isfinite(x) else None


def _count(x: Optional[float]) -> str:
    return "-" if x is None else f"{math.ceil(x)}"


def resolution_markdown(rows: Sequence[dict], scale: float = 100.0,
                        metric: str = "final held-out accuracy") -> str:
    summary = resolution(rows)
    out = ["| lag | comparisons | seeds | SD of paired diff | 95% half-width median / max | "
           "MDE (80% power) median / max | half-width <= 5 pts | seeds each comparison needs "
           "for it, median / p90 / max | significant | expected by chance |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        out.append(f"| {r['lag']} | {r['comparisons']} | {r['seeds']} | "
                   f"{r['pooled_sd'] * scale:.1f} | {r['half_median'] * scale:.1f} / "
                   f"{r['half_max'] * scale:.1f} | {r['mde_median'] * scale:.1f} / "
                   f"{r['mde_max'] * scale:.1f} | {'yes' if r['goal_met'] else 'no'} | "
                   f"{_count(r['seeds_needed_median'])} / {_count(r['seeds_needed_p90'])} / "
                   f"{_count(r['seeds_needed_max'])} | "
                   f"{r['significant']} | {r['expected_false_positives']:.1f} |")
    n = sum(r["comparisons"] for r in summary)
    lags = ", ".join(str(r["lag"]) for r in summary)
    out += ["", f"Every pair of arms at lag {lags}, {metric}, paired by seed "
                f"(points). MDE: the smallest true difference the paired t-test detects with "
                f"80% power at 5% two-sided. Seeds needed: per comparison, the fewest seeds "
                f"whose paired 95% half-width at that comparison's SD is <= 5 points "
                f"(stats.seeds_for_half_width). {n} comparisons: at a 5% level ~{0.05 * n:.0f} "
                f"would come out significant by chance alone if no loss differed."]
    return "\n".join(out)


def identical_markdown(same: Sequence[dict], notes: Dict[str, str]) -> str:
    """The identical pairs (those identical beyond lag 0 first: two names for one update) and
    what each decoupled arm reduces to."""
    out = []
    beyond = [p for p in same if any(k > 0 for k in p["lags"])]
    at0 = [p for p in same if p["lags"] == [0]]
    for p in beyond:
        out.append(f"- **{p['a']} and {p['b']} are identical** in {p['identical']} of "
                   f"{p['shared']} shared runs (lags {', '.join(map(str, p['lags']))}): two "
                   f"arms, one update.")
    if at0:
        out.append("- Identical at lag 0 only (on-policy, where these corrections are "
                   "inactive): " + "; ".join(f"{p['a']} = {p['b']}" for p in at0) + ".")
    if not same:
        out.append("- No two arms are identical in any run.")
    for label, note in notes.items():
        out.append(f"- At minibatches=1, `{label}` is {note}.")
    return "\n".join(out)


def pairwise_markdown(rows: Sequence[dict], scale: float = 100.0) -> str:
    """The pairs whose uncorrected 95% interval excludes 0, each with its MDE, raw p and p
    Holm-adjusted within its lag (bold where < 0.05: significant under the protocol's rule for
    all pairs at a lag)."""
    sig = [r for r in rows if r["verdict"] in ("better", "worse")]
    if not sig:
        return "No pair of arms differs significantly at any lag >= 4, even uncorrected."
    out = ["| lag | a | b | a - b (pts) | 95% half-width | MDE | p | p (Holm, within the lag) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sorted(sig, key=lambda r: (r["lag"], -abs(r["diff"]))):
        q = r["p_holm_lag"]
        holm = f"**{q:.3g}**" if q < protocol.ALPHA else f"{q:.3g}"
        out.append(f"| {r['lag']} | {r['a']} | {r['b']} | {r['diff'] * scale:+.1f} | "
                   f"{r['half'] * scale:.1f} | {r['mde'] * scale:.1f} | {r['p']:.3g} | "
                   f"{holm} |")
    held = sum(r["p_holm_lag"] < protocol.ALPHA for r in sig)
    counts = {}
    for r in rows:
        counts[r["lag"]] = counts.get(r["lag"], 0) + 1
    out += ["", f"Secondary. Listed: the pairs whose uncorrected 95% interval excludes 0 "
                f"({len(sig)}). Holm within each lag (over its "
                f"{', '.join(f'{n} pairs at lag {k}' for k, n in sorted(counts.items()))}), "
                f"the protocol's rule for all pairs at a lag: {held} of {len(sig)} hold "
                f"(bold)."]
    return "\n".join(out)


def reductions(grid: Grid) -> Dict[str, str]:
    """What each arm's loss reduces to under its runs' settings, where it is not what its name
    says: at minibatches=1 the learner's proximal policy is the current one (r = 1), so a
    decoupled objective's clip on r never binds and only its behaviour weight acts."""
    from pipelinerl_jax.losses import get_loss  # jax import: only here
    notes = {}
    for label, cells in grid.items():
        r = next(iter(next(iter(cells.values())).values()))
        loss = r.get("loss") or {}
        name = loss.get("name") if isinstance(loss, dict) else r.get("loss.name")
        mb = int(r.get("learner.minibatches", 1) or 1)
        if not name or mb != 1:
            continue
        hp = {k: v for k, v in (loss if isinstance(loss, dict) else {}).items()
              if k != "name" and v is not None}
        try:
            h = get_loss(name, **hp).hparams
        except Exception:  # noqa: BLE001 - an unknown loss in old runs: no note
            continue
        if name == "decoupled_ppo":
            cap = "uncapped" if h["behave_cap"] is None else f"capped at {h['behave_cap']:g}"
            notes[label] = (f"token IS against the behaviour policy, weight {cap} (= tis with "
                            f"that cap, in gradient); its PPO clip never binds")
        elif name == "icepop":
            notes[label] = (f"token IS against the behaviour policy, tokens with weight outside "
                            f"[{h['band_low']:g}, {h['band_high']:g}] masked; its PPO clip never "
                            f"binds")
        elif name == "staleness_clip":
            notes[label] = (f"token TIS with cap 1 + ({h['cap']:g} - 1)·s(lag) (= tis with "
                            f"cap {h['cap']:g} at lag 0, in gradient); its PPO clip never binds")
    return notes


# ============================================================================ drift

def drift_stalest(r: Run) -> Optional[float]:
    """KL(behaviour || current), k3, token-weighted over the stalest lag bucket of the run."""
    return stalest_diagnostics(r)["kl_k3_stalest"]


def drift_cells(grids: Dict[float, Grid]) -> List[dict]:
    """One row per (learning rate, loss, lag > 0) with a lag-0 reference: the paired accuracy
    drop to lag 0 and the measured drift (KL k3 and ESS of the stalest bucket, means over
    seeds). `grids`: {learning rate: Grid}; rows in increasing rate, `group` its label."""
    rows = []
    for lr in sorted(grids):
        grid, group = grids[lr], f"lr {lr:g}"
        for loss in _order(grid):
            ref = grid[loss].get(0)
            if ref is None:
                continue
            for k in sorted(grid[loss]):
                if k == 0:
                    continue
                c = versus(grid[loss][k], ref)
                kl = cell_interval(grid[loss][k], drift_stalest)
                ess = cell_interval(grid[loss][k], ess_stalest)
                if c.verdict == "n/a" or not kl.n:
                    continue
                rows.append({"group": group, "lr": lr, "loss": loss, "lag": k, "drop": c.diff,
                             "half": c.half, "verdict": c.verdict, "kl_k3": kl.mean,
                             "ess": ess.mean, "n": c.n})
    return rows


def _r2(x: np.ndarray, y: np.ndarray) -> Optional[float]:
    if x.size < 3 or np.std(x) == 0:
        return None
    slope, icpt = np.polyfit(x, y, 1)
    res = y - (slope * x + icpt)
    tot = np.sum((y - y.mean()) ** 2)
    return float(1.0 - np.sum(res ** 2) / tot) if tot > 0 else None


def kl_vs_inputs(rows: Sequence[dict], base=lambda loss: loss.split(" (")[0]) -> dict:
    """The measured drift as what it is, an outcome of the run (docs/staleness_study.md,
    Protocol: KL is never a predictor of the drop): per loss, pooled over the learning
    rates, how log KL k3 of the stalest bucket follows the inputs set before the run, as
    the in-sample R² of a line on log lag and on log(rate x lag), and the Spearman
    correlation of KL with rate x lag. Descriptive; the drop is modelled in ablation/drift."""
    per = {}
    for loss in sorted({base(r["loss"]) for r in rows}):
        rs = [r for r in rows if base(r["loss"]) == loss and r["kl_k3"] and r["kl_k3"] > 0]
        if len({r["lr"] for r in rs}) < 2:
            continue
        kl = np.log(np.asarray([r["kl_k3"] for r in rs]))
        lag = np.log(np.asarray([r["lag"] for r in rs], float))
        product = np.log(np.asarray([r["lr"] * r["lag"] for r in rs]))
        per[loss] = {"cells": len(rs), "r2_kl_on_lag": _r2(lag, kl),
                     "r2_kl_on_product": _r2(product, kl),
                     "spearman_kl_product": _corr(_ranks(product), _ranks(kl))}
    return per


def drift_markdown(rows: Sequence[dict], per: dict, scale: float = 100.0) -> str:
    groups = [f"lr {lr:g}" for lr in sorted({r["lr"] for r in rows})]
    out = ["| arm | lag | drop vs lag 0 (pts) | KL k3, stalest bucket | ESS, stalest bucket |",
           "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['loss']} | {r['lag']} | {r['drop'] * scale:+.1f} ± "
                   f"{r['half'] * scale:.1f} | {r['kl_k3']:.3g} | {r['ess']:.2f} |")
    out += ["", f"Groups: {', '.join(groups)}.", "",
            "| loss | cells | R² of log KL on log lag | R² of log KL on log(rate x lag) | "
            "Spearman of KL with rate x lag |", "|---|---|---|---|---|"]

    def num(v):
        return "n/a" if v is None else f"{v:.2f}"
    for loss, a in per.items():
        out.append(f"| {loss} | {a['cells']} | {num(a['r2_kl_on_lag'])} | "
                   f"{num(a['r2_kl_on_product'])} | {num(a['spearman_kl_product'])} |")
    out += ["", "KL is an outcome of each run (measured on its own batches): this table "
            "describes how it follows the inputs set before the run (in-sample, over cells, "
            "the rates pooled), and is never used to predict the accuracy drop (the drift "
            "models above do that from the inputs alone)."]
    return "\n".join(out)


# ============================================================================ lag contrasts

def lag_contrasts(grid: Grid, fn=final_accuracy) -> List[dict]:
    """Each arm at each lag > 0 against the same arm at lag 0, paired by seed: what a
    lag-injected grid shows first (experiments/ablate.py prints it)."""
    rows = []
    for arm in _order(grid):
        cells = grid[arm]
        for k in sorted(x for x in cells if x > 0 and 0 in cells):
            c = versus(cells[k], cells[0], fn)
            rows.append({"arm": arm, "lag": k, "n": c.n, "diff": c.diff, "half": c.half,
                         "verdict": c.verdict})
    return rows


def lag_contrasts_text(rows: Sequence[dict], scale: float = 100.0) -> str:
    return "\n".join(
        f"{r['arm']}: lag {r['lag']} - lag 0 = {r['diff'] * scale:+.1f} "
        + (f"± {r['half'] * scale:.1f} pts (95% paired t, {r['n']} seeds; {r['verdict']})"
           if math.isfinite(r["half"]) else f"pts ({r['n']} seed{'s' * (r['n'] != 1)}: no "
                                            f"interval)")
        for r in rows)
