"""Shared plotting helpers of the ablation figures (figures.py, study_figures.py)."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["DPI", "Skip", "colors", "plt", "save", "smooth"]
import numpy as np  # noqa: E402

DPI = 90


class Skip(Exception):
    """A figure that cannot be drawn from the runs given (the message says why)."""


def save(fig, out: str, name: str) -> str:
    """Writes OUT/name.png and OUT/name.svg; returns the PNG's path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name + ".png")
    fig.savefig(path, dpi=DPI)
    fig.savefig(os.path.join(out, name + ".svg"))
    plt.close(fig)
    return path


def smooth(y: np.ndarray, n: int) -> np.ndarray:
    if n <= 1 or y.size < n:
        return y
    k = np.ones(n) / n
    pad = np.concatenate([np.full(n // 2, y[0]), y, np.full(n - 1 - n // 2, y[-1])])
    return np.convolve(pad, k, mode="valid")


def colors(n):
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]
