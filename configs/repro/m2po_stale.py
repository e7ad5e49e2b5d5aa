"""Repro: M2PO (arXiv 2510.01161) stays stable on very stale data while plain truncated IS
(`tis`, cap 2) degrades. The paper reports stability at >= 256 versions stale.

    python experiments/ablate.py --config=configs/repro/m2po_stale.py --workdir=runs/staleness
    python experiments/ablate.py --config=configs/repro/m2po_stale.py:long --workdir=runs/staleness
    PYTHONPATH=. python scripts/repro_verdict.py --name=m2po_stale --results=runs/staleness
    PYTHONPATH=. python scripts/repro_verdict.py --name=m2po_stale_long --results=runs/staleness

Both forms of M2PO (`m2po`: the paper's masking; the authors' released code as their scripts
run it, `m2po_authors`, and with the clip floor [0.7, 1.5], `m2po_released`: docs/losses.md)
against `tis`. Default: lag {0, 8, 32}, 60 steps, the staleness grid's seeds:
exactly that grid's `m2po`, `m2po_released`, `m2po_authors` and `tis` cells (same names and configs), so in
that grid's workdir every run is reused and nothing new runs; `:lowlr` likewise in the
`staleness.py:lowlr` workdir. With lag = min(k, step), a 60-step run trains 28 steps at lag 32.
`:long`: lag {0, 32, 64} over 160 steps (96 steps at lag 64; the learner keeps 64 old
versions, a few MB at this model size), under an extra one-level axis `steps=160` so the
run names differ from the 60-step grid's (a finished run of the same name is never rerun);
its verdict and figure are `m2po_stale_long` (the `steps` label keeps the two apart).
4 arms x 3 lags x the grid's seeds.
"""
from configs.ablate import staleness
from pipelinerl_jax.ablation.grid import sweep, variants


def get_config(arg: str = ""):
    c = staleness.get_config("lowlr" if arg == "lowlr" else "")
    arms = dict(staleness.LOSS_ARMS)  # the same arms (names and configs) as that grid
    c.axes.loss = variants(*[(a, arms[a]) for a in ("m2po", "m2po_released", "m2po_authors",
                                                    "tis")])
    c.axes.lag.levels = (0, 8, 32)
    if arg == "long":
        c.axes.lag.levels = (0, 32, 64)
        c.axes.steps = sweep("learner.total_steps", (160,))
    elif arg not in ("", "lowlr"):
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'long', 'lowlr')")
    return c
