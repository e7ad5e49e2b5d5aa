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
R² = 1 - SSE / SST with SST around the mean drop. Lag 0 is the reference, so it has no row.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

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
                    rows.append({"loss": loss.split(" (")[0], "lr": float(lr), "lag": int(lag),
                                 "seed": int(seed), "drop": float(a - b)})
    return rows


def _fit_predict(x_fit: np.ndarray, y_fit: np.ndarray, x_new: np.ndarray) -> np.ndarray:
    design = np.column_stack([np.ones(len(x_fit)), x_fit])
    coef, *_ = np.linalg.lstsq(design, y_fit, rcond=None)
    return np.column_stack([np.ones(len(x_new)), x_new]) @ coef


def loso_r2(rows: Sequence[dict], model: str) -> Optional[float]:
    """Leave-one-seed-out cross-validated R² of `MODELS[model]` over `rows` (None with fewer
    than three seeds or no spread in the drops)."""
    seeds = sorted({r["seed"] for r in rows})
    if len(seeds) < 3:
        return None
    x = np.asarray([MODELS[model](r["lr"], r["lag"]) for r in rows], float)
    y = np.asarray([r["drop"] for r in rows], float)
    s = np.asarray([r["seed"] for r in rows])
    sst = float(np.sum((y - y.mean()) ** 2))
    if sst == 0:
        return None
    pred = np.empty_like(y)
    for seed in seeds:
        out = s == seed
        pred[out] = _fit_predict(x[~out], y[~out], x[out])
    return 1.0 - float(np.sum((y - pred) ** 2)) / sst


def drift_models(rows: Sequence[dict]) -> Dict[str, dict]:
    """Per loss with at least two learning rates and two nonzero lags: each model's
    leave-one-seed-out R², the best model, and the counts."""
    per = {}
    for loss in sorted({r["loss"] for r in rows}):
        rs = [r for r in rows if r["loss"] == loss]
        if len({r["lr"] for r in rs}) < 2 or len({r["lag"] for r in rs}) < 2:
            continue
        r2 = {m: loso_r2(rs, m) for m in MODELS}
        scored = {m: v for m, v in r2.items() if v is not None}
        per[loss] = {"rows": len(rs), "seeds": len({r["seed"] for r in rs}),
                     "rates": sorted({r["lr"] for r in rs}),
                     "lags": sorted({r["lag"] for r in rs}), "cv_r2": r2,
                     "best": max(scored, key=scored.get) if scored else None}
    return per


def drift_models_markdown(per: Dict[str, dict]) -> str:
    names = list(MODELS)
    out = ["| loss | seed drops | seeds | " + " | ".join(f"CV R², {m}" for m in names)
           + " | best |", "|---|---|---|" + "---|" * len(names) + "---|"]
    for loss, a in per.items():
        cells = ["n/a" if a["cv_r2"][m] is None else f"{a['cv_r2'][m]:.2f}" for m in names]
        out.append(f"| {loss} | {a['rows']} | {a['seeds']} | " + " | ".join(cells)
                   + f" | {a['best'] or 'n/a'} |")
    out += ["", "Inputs set before each run only (its lag and learning rate); each seed's drop "
            "is predicted by the model fitted to the other seeds (leave-one-seed-out)."]
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


def published_terms_figure(rows: Sequence[dict], out: str,
                           name: str = "drop_vs_rate_x_updates") -> str:
    """Each cell's mean seed-paired drop (one line per loss, learning rates as markers)
    against learning rate x updates (lag x 1 minibatch here), with the published runs'
    products as vertical lines. Writes OUT/name.png (and .svg); returns the PNG's path."""
    from pipelinerl_jax.ablation import plotting
    if not rows:
        raise plotting.Skip("no seed-paired drops")
    cells: Dict[tuple, List[float]] = {}
    for r in rows:
        cells.setdefault((r["loss"], r["lr"], r["lag"]), []).append(r["drop"])
    losses, rates = sorted({k[0] for k in cells}), sorted({k[1] for k in cells})
    marks = "osD^v"
    fig, ax = plotting.plt.subplots(figsize=(8, 5))
    for color, loss in zip(plotting.colors(len(losses)), losses):
        label = loss  # on the loss's first line only
        for mark, lr in zip(marks, rates):
            pts = sorted((lr * lag, 100 * float(np.mean(v)))
                         for (l_, r_, lag), v in cells.items() if l_ == loss and r_ == lr)
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
