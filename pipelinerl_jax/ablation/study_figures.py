"""Figures of the staleness study and of the published-phenomenon experiments (registered in
figures.FIGURES, drawn by scripts/reproduce_figures.py). Every point is a mean over seeds
with its 95% Student-t interval (stats.py).

  ess_vs_drop            left: ESS of the stalest lag bucket vs injected lag per loss, with
                         the 0.5 line; right: per cell (loss, lag > 0), that ESS vs the
                         accuracy difference to the loss's lag 0 (filled: significant drop)
  drop_vs_drift          per cell (loss, lag > 0) of each learning rate: the accuracy
                         difference to the loss's lag 0 against the measured drift (KL k3 of
                         the stalest bucket; left) and against the lag (right) — if drift,
                         not lag, sets the drop, the learning rates line up on the left
  repro_tinker_kl        KL(behaviour || current) k3 over training for unclipped IS and PPO
                         at lag 0 and ~3, and their final accuracy (configs/repro/tinker_kl.py)
  repro_m2po_stale       final accuracy vs lag, m2po vs tis (configs/repro/m2po_stale.py)
  repro_decoupled_ppo    final accuracy vs lag, decoupled PPO vs PPO with minibatches > 1
                         (configs/repro/decoupled_ppo.py)
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from pipelinerl_jax.ablation import repro, stats
from pipelinerl_jax.ablation.plotting import Skip, colors, plt, save
from pipelinerl_jax.ablation.results import Run
from pipelinerl_jax.ablation.staleness import (by_learning_rate, cell_interval, drift_cells,
                                               kl_vs_inputs, ess_analysis, ess_stalest,
                                               lag_grid, main_arms)


def _half(iv: stats.Interval) -> float:
    return iv.half if math.isfinite(iv.half) else 0.0


def ess_vs_drop(runs: Sequence[Run], out: str) -> dict:
    grid = lag_grid(runs)
    grid = {k: v for k, v in grid.items() if 0 in v and len(v) > 1}
    if not grid:
        raise Skip("needs lag-injected runs at lag 0 and at a lag > 0 (configs/ablate/"
                   "staleness.py)")
    a = ess_analysis(grid)
    lags = sorted({k for cells in grid.values() for k in cells})
    fig, (ax, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (loss, by_lag), color in zip(sorted(grid.items()), colors(len(grid))):
        ks = sorted(by_lag)
        ivs = [cell_interval(by_lag[k], ess_stalest) for k in ks]
        x = [lags.index(k) for k in ks]
        ax.errorbar(x, [i.mean for i in ivs], yerr=[_half(i) for i in ivs], color=color,
                    marker="o", ms=4, lw=1.3, capsize=2, label=loss)
        cells = [c for c in a["cells"] if c["loss"] == loss]
        for c in cells:
            ax_s.errorbar([c["ess"]], [100 * c["diff"]], yerr=[[100 * _h(c)], [100 * _h(c)]],
                          color=color, marker="o", ms=6, capsize=2, lw=0.8,
                          mfc=color if c["dropped"] else "white")
    ax.axhline(a["threshold"], color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(lags)), [str(k) for k in lags])
    ax.set(xlabel="injected lag k (versions)", ylabel="ESS of the stalest lag bucket",
           title="ESS of the stalest bucket (mean, 95% t)")
    ax.legend(fontsize=7, ncol=2)
    ax_s.axvline(a["threshold"], color="gray", ls=":", lw=1)
    ax_s.axhline(0, color="gray", ls=":", lw=1)
    ax_s.set(xlabel="ESS of the stalest bucket (cell mean)",
             ylabel="final accuracy - lag 0 (points, paired 95% t)",
             title="does ESS < 0.5 predict the drop? (filled: significant)")
    c = a.get("classifier")
    if c:
        ax_s.text(0.02, 0.03, f"ESS < {a['threshold']:g} => drop: right in {c['accuracy']:.0%}"
                  f" of {c['cells']} cells", transform=ax_s.transAxes, fontsize=8,
                  bbox=dict(boxstyle="round", fc="white", alpha=0.85))
    for x in (ax, ax_s):
        x.grid(alpha=0.3)
    fig.tight_layout()
    return {"path": save(fig, out, "ess_vs_drop"),
            "ess_below_lag": {k: v["ess_below_lag"] for k, v in a["losses"].items()},
            "drop_lag": {k: v["drop_lag"] for k, v in a["losses"].items()},
            "classifier": a.get("classifier"), "pearson": a.get("pearson")}


def drop_vs_drift(runs: Sequence[Run], out: str) -> dict:
    groups = by_learning_rate(runs)
    if len(groups) < 2:
        raise Skip("needs lag-injected grids at two learning rates (configs/ablate/staleness.py "
                   "and its :lowlr)")
    cells = drift_cells({lr: main_arms(g) for lr, g in groups.items()})
    if not cells:
        raise Skip("needs cells at lag 0 and lag > 0 with per-bucket KL")
    per = kl_vs_inputs(cells)
    base = sorted({c["loss"].split(" (")[0] for c in cells})
    color = dict(zip(base, colors(len(base))))
    rates = sorted({c["lr"] for c in cells})  # numeric order; one marker and offset each
    marks = {f"lr {lr:g}": m for lr, m in zip(rates, "os^Dv")}
    shift = {f"lr {lr:g}": 1.06 ** i for i, lr in enumerate(rates)}
    fig, (ax, ax_lag) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for c in cells:
        b = c["loss"].split(" (")[0]
        kw = dict(color=color[b], marker=marks[c["group"]], ms=5, capsize=2, lw=0.8,
                  mfc=color[b] if c["verdict"] == "worse" else "white")
        ax.errorbar([c["kl_k3"]], [100 * c["drop"]], yerr=[[100 * _h(c)], [100 * _h(c)]], **kw)
        ax_lag.errorbar([c["lag"] * shift[c["group"]]],
                        [100 * c["drop"]], yerr=[[100 * _h(c)], [100 * _h(c)]], **kw)
    for b in base:
        ax.plot([], [], color=color[b], lw=2, label=b)
    for g, m in marks.items():
        ax.plot([], [], "k" + m, mfc="white", label=g)
    ax.set_xscale("log")
    ax_lag.set_xscale("log", base=2)
    ax.set(xlabel="measured drift: KL(behaviour || current) k3, stalest bucket (cell mean)",
           ylabel="final accuracy - lag 0 (points, paired 95% t)",
           title="drop vs measured drift, two outcomes (filled: significant)")
    ax_lag.set(xlabel="injected lag k (versions)", title="drop vs lag")
    for x in (ax, ax_lag):
        x.axhline(0, color="gray", ls=":", lw=1)
        x.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return {"path": save(fig, out, "drop_vs_drift"), "per_loss": per, "cells": len(cells)}


def _h(c: dict) -> float:
    return c["half"] if math.isfinite(c["half"]) else 0.0


def _accuracy_vs_lag(ax, grid) -> None:
    lags = sorted({k for cells in grid.values() for k in cells})
    for i, ((arm, by_lag), color) in enumerate(zip(sorted(grid.items()), colors(len(grid)))):
        ks = sorted(by_lag)
        ivs = [cell_interval(by_lag[k]) for k in ks]
        x = np.asarray([lags.index(k) for k in ks], float) + 0.06 * (i - (len(grid) - 1) / 2)
        ax.errorbar(x, [100 * v.mean for v in ivs], yerr=[100 * _half(v) for v in ivs],
                    color=color, marker="o", ms=5, lw=1.5, capsize=3, label=arm)
    ax.set_xticks(range(len(lags)), [str(k) for k in lags])
    ax.set(xlabel="injected lag k (versions)", ylabel="final held-out accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _repro(name: str, runs: Sequence[Run], out: str, kl: bool = False) -> dict:
    """One column per learning rate with every cell the phenomenon needs (its regime):
    accuracy vs lag per arm, and for `kl` the arms' KL over training above it."""
    regimes = repro.regimes(name, runs)
    judged = [(v, g) for g, v in regimes if "missing" not in v]
    if not judged:
        missing = regimes[0][1].get("missing", [])
        raise Skip(f"needs {', '.join(missing)} (configs/repro/{name}.py)")
    rows = 2 if kl else 1
    fig, axes = plt.subplots(rows, len(judged), figsize=(6 * len(judged), 4.2 * rows),
                             squeeze=False)
    for col, (v, grid) in enumerate(judged):
        _accuracy_vs_lag(axes[-1, col], grid)
        axes[-1, col].set_title(f"{name}, {v['regime']}: {v['verdict']} (mean, 95% t over "
                                f"seeds)", fontsize=10)
        if kl:
            _kl_over_training(axes[0, col], grid, v["lag"])
    fig.tight_layout()
    return {"path": save(fig, out, f"repro_{name}"),
            "regimes": {v["regime"]: {"verdict": v["verdict"], "claims": v["claims"]}
                        for v, _ in judged}}


def _kl_over_training(ax, grid, lag: int) -> None:
    for (arm, by_lag), color in zip(sorted(grid.items()), colors(len(grid))):
        for k, ls in ((0, ":"), (lag, "-")):
            series = [r.series("loss/kl_k3") for r in by_lag.get(k, {}).values()]
            if not series:
                continue
            steps = sorted(set.intersection(*[set(s.tolist()) for s, _, _ in series]))
            ivs = [stats.t_interval([float(val[list(s).index(t)]) for s, _, val in series])
                   for t in steps]
            m = np.asarray([i.mean for i in ivs])
            h = np.asarray([_half(i) for i in ivs])
            ax.plot(steps, m, ls=ls, color=color, lw=1.4, label=f"{arm}, lag {k}")
            ax.fill_between(steps, np.maximum(m - h, 1e-12), m + h, color=color, alpha=0.15)
    ax.set(yscale="log", xlabel="learner step", ylabel="KL(behaviour || current), k3",
           title="sampler-trainer drift (mean, 95% t band)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def repro_tinker_kl(runs: Sequence[Run], out: str) -> dict:
    return _repro("tinker_kl", runs, out, kl=True)


def repro_m2po_stale(runs: Sequence[Run], out: str) -> dict:
    return _repro("m2po_stale", runs, out)


def repro_m2po_stale_long(runs: Sequence[Run], out: str) -> dict:
    return _repro("m2po_stale_long", runs, out)


def repro_decoupled_ppo(runs: Sequence[Run], out: str) -> dict:
    return _repro("decoupled_ppo", runs, out)


FIGURES = {"ess_vs_drop": ess_vs_drop, "drop_vs_drift": drop_vs_drift, "repro_tinker_kl": repro_tinker_kl,
           "repro_m2po_stale": repro_m2po_stale, "repro_m2po_stale_long": repro_m2po_stale_long,
           "repro_decoupled_ppo": repro_decoupled_ppo}
