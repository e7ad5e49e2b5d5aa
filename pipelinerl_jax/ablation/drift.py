"""The protocol's drift models (docs/staleness_study.md, "Drift"): does the accuracy cost of
staleness follow the lag, the learning rate, or their product? Answered with inputs that are
set before a run starts, never with the KL the run measures on its own batches (an outcome).

    rows = seed_drops(grids)                 # {lr: Grid} -> one row per (loss, lr, lag > 0, seed)
    per = drift_models(rows)                 # {loss: {model: leave-one-seed-out CV R², ...}}
    print(drift_models_markdown(per))

Each row is one seed's paired drop: its final accuracy at (loss, lr, lag) minus the same
seed's at (loss, lr, lag 0). Per loss, four linear models of the drop (least squares, with an
intercept) on log lag, log rate, both, and log(rate x lag) (both with one shared slope: the
"updates x step size" reading of staleness) are scored by leave-one-seed-out cross-validated
R²: every seed's rows are predicted by the model fitted to the other seeds' rows, and
R² = 1 - PRESS / SST with SST around the mean of all drops (the predictive R², Q²: a model
no better than a constant scores just below 0). Lag 0 is the reference, so it has no row.

Which model the drops follow is decided by a rule stated before the `drift` grid was read
(2026-12-06, sitting 21; docs/staleness_study.md, Deviations), with the seed as the
replicate: two nested comparisons, each the difference in CV R² with a 95% t-interval over
seeds (each seed's share of the held-out SSE difference, `delta_r2`):
  rate adds   (log lag + log rate) - (log lag) > 0, the interval above 0
  lag adds    (log lag + log rate) - (log rate) > 0
  both add    the product's one slope suffices unless (log(rate x lag)) - (log lag + log
              rate) is below 0 with its interval: then both slopes are needed
  one adds    that input alone
  neither     "none" (in the grid's full factorial design lag and rate are orthogonal, so
              "lag adds to rate" is the test of lag itself), as when no CV R² is above 0.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.ablation import stats
from pipelinerl_jax.ablation.staleness import Grid, final_accuracy

# model name -> the features of a row (its learning rate and lag), all known before the run
MODELS: Dict[str, Callable[[float, int], List[float]]] = {
    "log lag": lambda lr, lag: [math.log(lag)],
    "log rate": lambda lr, lag: [math.log(lr)],
    "log lag + log rate": lambda lr, lag: [math.log(lag), math.log(lr)],
    "log(rate x lag)": lambda lr, lag: [math.log(lr * lag)],
}


def seed_drops(grids: Dict[float, Grid], fn=final_accuracy) -> List[dict]:
    """One row per (loss, learning rate, lag > 0, seed) with that seed's run at lag 0 of the
    same loss and rate: `drop` = fn(run) - fn(lag-0 run) (negative: a cost)."""
    rows = []
    for lr, grid in grids.items():
        for loss, cells in grid.items():
            ref = cells.get(0, {})
            for lag, cell in cells.items():
                if lag <= 0:
                    continue
                for seed, run in cell.items():
                    if seed not in ref:
                        continue
                    a, b = fn(run), fn(ref[seed])
                    if a is None or b is None:
                        continue
                    mb = int((run.get("learner.minibatches", 1) if hasattr(run, "get")
                              else 1) or 1)
                    rows.append({"loss": loss.split(" (")[0], "lr": float(lr), "lag": int(lag),
                                 "seed": int(seed), "drop": float(a - b), "minibatches": mb})
    return rows


def _fit_predict(x_fit: np.ndarray, y_fit: np.ndarray, x_new: np.ndarray) -> np.ndarray:
    design = np.column_stack([np.ones(len(x_fit)), x_fit])
    coef, *_ = np.linalg.lstsq(design, y_fit, rcond=None)
    return np.column_stack([np.ones(len(x_new)), x_new]) @ coef


def _held_out(rows: Sequence[dict], model: str) -> Optional[tuple]:
    """(seeds, each seed's held-out SSE, SST) of `MODELS[model]`, leave-one-seed-out (None
    with fewer than three seeds or no spread in the drops)."""
    seeds = sorted({r["seed"] for r in rows})
    if len(seeds) < 3:
        return None
    x = np.asarray([MODELS[model](r["lr"], r["lag"]) for r in rows], float)
    y = np.asarray([r["drop"] for r in rows], float)
    s = np.asarray([r["seed"] for r in rows])
    sst = float(np.sum((y - y.mean()) ** 2))
    if sst == 0:
        return None
    sse = []
    for seed in seeds:
        out = s == seed
        sse.append(float(np.sum((y[out] - _fit_predict(x[~out], y[~out], x[out])) ** 2)))
    return seeds, np.asarray(sse), sst


def loso_r2(rows: Sequence[dict], model: str) -> Optional[float]:
    """Leave-one-seed-out cross-validated R² of `MODELS[model]` over `rows` (None with fewer
    than three seeds or no spread in the drops)."""
    h = _held_out(rows, model)
    return None if h is None else 1.0 - float(h[1].sum()) / h[2]


def delta_r2(rows: Sequence[dict], a: str, b: str) -> Optional[dict]:
    """CV R² of model `a` minus model `b` with its 95% t-interval over seeds: seed s
    contributes d_s = (SSE_b,s - SSE_a,s) / SST, the difference is sum d_s = n mean(d), and
    its interval n times the t-interval of mean(d) (the seed is the replicate)."""
    ha, hb = _held_out(rows, a), _held_out(rows, b)
    if ha is None or hb is None:
        return None
    d = (hb[1] - ha[1]) / ha[2]
    iv = stats.t_interval(d.tolist())
    n = len(d)
    return {"diff": n * iv.mean, "low": n * (iv.mean - iv.half),
            "high": n * (iv.mean + iv.half), "seeds": n}


def choose(r2: Dict[str, Optional[float]], rate_adds: Optional[dict],
           lag_adds: Optional[dict], product_vs_both: Optional[dict]) -> Optional[str]:
    """The rule in the module docstring: the model the drops follow, or "none"."""
    scored = [v for v in r2.values() if v is not None]
    if not scored or None in (rate_adds, lag_adds, product_vs_both):
        return None
    if max(scored) <= 0:
        return "none"
    rate, lag = rate_adds["low"] > 0, lag_adds["low"] > 0
    if rate and lag:
        return "log lag + log rate" if product_vs_both["high"] < 0 else "log(rate x lag)"
    if rate:
        return "log rate"
    return "log lag" if lag else "none"


def drift_models(rows: Sequence[dict]) -> Dict[str, dict]:
    """Per loss with at least two learning rates and two nonzero lags: each model's
    leave-one-seed-out R², the best model, and the counts."""
    per = {}
    for loss in sorted({r["loss"] for r in rows}):
        rs = [r for r in rows if r["loss"] == loss]
        if len({r["lr"] for r in rs}) < 2 or len({r["lag"] for r in rs}) < 2:
            continue
        r2 = {m: loso_r2(rs, m) for m in MODELS}
        both = "log lag + log rate"
        tests = {"rate adds": delta_r2(rs, both, "log lag"),
                 "lag adds": delta_r2(rs, both, "log rate"),
                 "product vs both": delta_r2(rs, "log(rate x lag)", both)}
        per[loss] = {"rows": len(rs), "seeds": len({r["seed"] for r in rs}),
                     "rates": sorted({r["lr"] for r in rs}),
                     "lags": sorted({r["lag"] for r in rs}), "cv_r2": r2, "tests": tests,
                     "best": choose(r2, *tests.values())}
    return per


def _delta(t: Optional[dict]) -> str:
    if t is None:
        return "n/a"
    mark = "**" if t["low"] > 0 or t["high"] < 0 else ""
    return f"{mark}{t['diff']:+.2f}{mark} [{t['low']:+.2f}, {t['high']:+.2f}]"


def drift_models_markdown(per: Dict[str, dict]) -> str:
    names = list(MODELS)
    tests = ("rate adds", "lag adds", "product vs both")
    out = ["| loss | seed drops | seeds | " + " | ".join(f"CV R², {m}" for m in names)
           + " | ΔR² rate added to lag | ΔR² lag added to rate | ΔR² one product slope vs "
           "two | the drops follow |",
           "|---|---|---|" + "---|" * (len(names) + len(tests)) + "---|"]
    for loss, a in per.items():
        cells = ["n/a" if a["cv_r2"][m] is None else f"{a['cv_r2'][m]:.2f}" for m in names]
        out.append(f"| {loss} | {a['rows']} | {a['seeds']} | " + " | ".join(cells) + " | "
                   + " | ".join(_delta(a["tests"][t]) for t in tests)
                   + f" | {a['best'] or 'n/a'} |")
    out += ["", "Inputs set before each run only (its lag and learning rate); each seed's drop "
            "is predicted by the model fitted to the other seeds (leave-one-seed-out; CV R² "
            "is Q² = 1 - PRESS/SST about the mean of all drops). ΔR²: the difference in CV R² "
            "with its 95% t-interval over seeds (bold: the interval excludes 0). The last "
            "column follows the rule fixed before the grid was read (ablation/drift.py): the "
            "rate matters if adding it to lag raises CV R² (interval above 0), lag likewise; "
            "if both matter, one slope on log(rate x lag) unless it is worse than two slopes "
            "(interval below 0); 'none' when neither input adds, or no model's CV R² is above 0."]
    return "\n".join(out)


# Published runs' staleness in the same terms, learning rate x optimizer updates between the
# policy that sampled and the one trained, read from the authors' released run scripts (Adam
# in both; one entry per script, nothing estimated). AReaL is not here: its released launch
# commands set the staleness (`max_head_offpolicyness=4`, 4 minibatches) but not the rate.
PUBLISHED = (
    # M2PO (arXiv 2510.01161), Infini-AI-Lab/M2PO train-scripts/m2po-qwen-math-7b-s{8,256}.sh:
    # optim.lr=1e-6; stale_iteration 2 and 64 x ppo minibatches 4 = 8 and 256 updates
    ("M2PO s8 (7B, lr 1e-6 x 8 updates)", 1e-6 * 8),
    ("M2PO s256 (7B, lr 1e-6 x 256 updates)", 1e-6 * 256),
)


def rate_x_updates(rows: Sequence[dict]) -> Dict[tuple, List[tuple]]:
    """{(loss, lr): [(lr x optimizer updates of staleness, mean drop in points), ...]} in
    increasing x, one point per cell; the updates are lag x the run's minibatches."""
    cells: Dict[tuple, List[float]] = {}
    for r in rows:
        cells.setdefault((r["loss"], r["lr"], r["lag"] * r.get("minibatches", 1)),
                         []).append(r["drop"])
    out: Dict[tuple, List[tuple]] = {}
    for (loss, lr, updates), v in cells.items():
        out.setdefault((loss, lr), []).append((lr * updates, 100 * float(np.mean(v))))
    return {k: sorted(v) for k, v in out.items()}


def published_terms_figure(rows: Sequence[dict], out: str,
                           name: str = "drop_vs_rate_x_updates") -> str:
    """Each cell's mean seed-paired drop (one line per loss, learning rates as markers)
    against learning rate x optimizer updates of staleness (lag x the run's minibatches),
    with the published runs' products as vertical lines. Writes OUT/name.png (and .svg);
    returns the PNG's path."""
    from pipelinerl_jax.ablation import plotting
    if not rows:
        raise plotting.Skip("no seed-paired drops")
    lines = rate_x_updates(rows)
    losses, rates = sorted({k[0] for k in lines}), sorted({k[1] for k in lines})
    marks = "osD^v"
    fig, ax = plotting.plt.subplots(figsize=(8, 5))
    for color, loss in zip(plotting.colors(len(losses)), losses):
        label = loss  # on the loss's first line only
        for mark, lr in zip(marks, rates):
            pts = lines.get((loss, lr))
            if pts:
                ax.plot(*zip(*pts), marker=mark, color=color, alpha=0.8, label=label)
                label = None
    for i, (label, x) in enumerate(PUBLISHED):
        ax.axvline(x, color="0.3", linestyle=":" if i % 2 else "--", linewidth=1)
        ax.text(x, 0.45, " " + label, transform=ax.get_xaxis_transform(),
                fontsize=7, rotation=90, va="bottom")
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate x optimizer updates of staleness (markers: "
                  + ", ".join(f"{m} lr {lr:g}" for m, lr in zip(marks, rates)) + ")")
    ax.set_ylabel("held-out accuracy vs lag 0, points (mean of seed pairs)")
    ax.set_title("Staleness in step-size terms, with the published runs' settings")
    ax.legend(fontsize=7, ncol=2)
    return plotting.save(fig, out, name)
