"""Matplotlib (Agg) plots of simulator results; small PNGs for docs and workdirs."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DPI = 90


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def rates(result):
    """Per series bin: generation tokens/s, mean batch per engine, sampler occupancy and
    learner busy fraction."""
    s = result.setup
    dt = s.series_dt_s
    t, b = result.series_t, result.series
    return {"t": t, "tokens_per_s": b["tokens"] / dt,
            "batch": b["slot_seconds"] / (dt * s.engines),
            "occupancy": b["slot_seconds"] / (dt * s.engines * s.slots),
            "learner_busy": np.minimum(1.0, (b["train_seconds"] + b["sync_seconds"]) / dt)}


def smooth(x, n):
    """Moving average over n bins (n <= 1: unchanged)."""
    if n <= 1 or x.size < n:
        return x
    return np.convolve(x, np.ones(n) / n, mode="same")


def plot_run(result, path, window_s: float | None = None):
    """Four panels: generation throughput, batch size, utilisation, staleness histogram."""
    r = rates(result)
    s = result.setup
    sel = slice(None) if window_s is None else r["t"] < window_s
    t = r["t"][sel]
    fig, ax = plt.subplots(2, 2, figsize=(9, 5.5))
    ax[0, 0].plot(t, r["tokens_per_s"][sel] / 1e3, lw=0.8)
    ax[0, 0].set(title="generation throughput", xlabel="time (s)", ylabel="k tokens/s")
    ax[0, 1].plot(t, r["batch"][sel], lw=0.8)
    ax[0, 1].set(title="batch size per engine", xlabel="time (s)", ylabel="running sequences")
    ax[1, 0].plot(t, r["occupancy"][sel], lw=0.8, label="samplers (slot occupancy)")
    ax[1, 0].plot(t, r["learner_busy"][sel], lw=0.8, label="learner (busy)")
    ax[1, 0].set(title="utilisation", xlabel="time (s)", ylim=(0, 1.05))
    ax[1, 0].legend(fontsize=7)
    h = result.start_lag_hist
    last = int(np.flatnonzero(h)[-1]) + 1 if h.any() else 1
    ax[1, 1].bar(np.arange(last), h[:last] / max(h.sum(), 1))
    ax[1, 1].set(title="start_lag of trained samples", xlabel="policy versions", ylabel="fraction")
    fig.suptitle(f"{s.mode}: {s.devices} devices"
                 + ("" if s.mode == "sync" else f" ({s.samplers} samplers / {s.trainers} trainers)"),
                 fontsize=10)
    save(fig, path)


def plot_sweep(sweep, path, title: str = ""):
    """Throughput and max staleness vs trainer devices, best split marked, sync as a line."""
    rows = [r for r in sweep["splits"] if "samples_per_s" in r]
    nt = np.asarray([r["trainers"] for r in rows])
    thr = np.asarray([r["samples_per_s"] for r in rows])
    stale = np.asarray([r["max_staleness"] for r in rows])
    mean_stale = np.asarray([r["mean_staleness"] for r in rows])
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(nt, thr, "o-", ms=3, color="C0", label="async throughput")
    if sweep.get("sync"):
        ax1.axhline(sweep["sync"]["samples_per_s"], color="gray", ls="--", lw=1,
                    label=f"sync on {sweep['devices']} devices")
    best = sweep.get("best")
    if best:
        ax1.plot([best["trainers"]], [best["samples_per_s"]], "*", ms=14, color="C3",
                 label=f"best: {best['trainers']} trainers"
                 + (f", {sweep['speedup_over_sync']:.2f}x sync" if sweep.get("speedup_over_sync") else ""))
    ax1.set(xlabel="trainer devices", ylabel="trained samples/s")
    ax2 = ax1.twinx()
    ax2.plot(nt, stale, "s-", ms=3, color="C1", lw=0.8, label="max staleness")
    ax2.plot(nt, mean_stale, "^-", ms=3, color="C1", lw=0.6, alpha=0.5, label="mean staleness")
    ax2.axhline(sweep["max_staleness"], color="C1", ls=":", lw=1, label="staleness limit")
    ax2.set_ylim(0, max(stale.max(initial=0), sweep["max_staleness"]) + 1)
    ax2.set_ylabel("start_lag (versions)", color="C1")
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax1.set_title(title or f"sampler/trainer split on {sweep['devices']} devices", fontsize=10)
    save(fig, path)


def plot_calibration(cal, path):
    keys = [k for k, v in cal["measured"].items() if v is not None]
    meas = [cal["measured"][k] for k in keys]
    pred = [cal["predicted"][k] for k in keys]
    fig, axes = plt.subplots(1, len(keys), figsize=(2.2 * len(keys), 3))
    for ax, k, m, p in zip(np.atleast_1d(axes), keys, meas, pred):
        ax.bar([0, 1], [m, p], color=["C0", "C1"])
        ax.set_xticks([0, 1], ["measured", "predicted"], fontsize=7)
        ax.set_title(k, fontsize=8)
    save(fig, path)
