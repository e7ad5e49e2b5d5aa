"""The protocol's `sweep` grid read as a study (docs/staleness_study.md, Protocol; the analysis
stated 2026-12-06, before any of the grid's results was read).

    grid = staleness.lag_grid(runs)                  # sweep arms: `ppo_eps0p1`, `tis_cap4`, ...
    ref = staleness.lag_grid(main_runs)              # the `''` grid: each loss at its default
    rows = sensitivity(grid, ref, lag=8)             # per loss: each setting vs its default
    print(section_markdown(grid, ref, 8, lr))

Each arm of the sweep is one loss at one value of its key setting, all at one lag. A loss's
default is the registry's value of that setting (losses/registry.py); its default cell is the
sweep's arm at that value, or, where the sweep holds none (decoupled_ppo: its default has no
behaviour cap), the `''` grid's arm of that loss at the same lag and seeds (`reference`).

On the primary endpoint (final held-out accuracy), seed-paired:
  sensitivity, one family per loss   each other setting against the default (Holm within the
                                     loss): does the setting matter at this lag;
  control                            where both hold a loss's default, the sweep's runs and the
                                     `''` grid's are the same configuration, code and machine:
                                     they should be identical run for run (a count, not a test);
  best setting (descriptive)         each loss's best setting and its margin over the default
                                     and over PPO-clip's default: chosen on these runs, so
                                     optimistic (no correction, labelled so).
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Tuple

from pipelinerl_jax.ablation import protocol, stats
from pipelinerl_jax.ablation.staleness import Grid, final_accuracy, fingerprint

# configs/ablate/staleness_protocol.py:sweep's labels: <arm>_<setting><value, '.' as 'p'>
_LABEL = re.compile(r"^(?P<arm>[a-z0-9_]+?)_(?P<key>eps|cap|tau|high)(?P<value>[0-9p]+)$")
# the key arm -> (registry loss, its extra hyperparameters, the hyperparameter the label's
# setting names)
ARMS = {"ppo": ("ppo", {}, "eps_low"), "tis": ("tis", {}, "cap"),
        "decoupled_ppo": ("decoupled_ppo", {}, "behave_cap"),
        "staleness_clip": ("staleness_clip", {}, "cap"),
        "m2po_authors": ("m2po", {"form": "released"}, "tau"),
        "seq_is": ("seq_is", {}, "high"), "vcpo": ("vcpo", {}, "cap")}
DEFAULT = "default"


def parse(label: str) -> Optional[Tuple[str, float]]:
    """`tis_cap1p5` -> ('tis', 1.5); None for a label that is not a sweep arm."""
    m = _LABEL.match(label)
    if not m or m["arm"] not in ARMS:
        return None
    return m["arm"], float(m["value"].replace("p", "."))


def default_value(arm: str) -> Optional[float]:
    """The registry's default of the arm's key setting (None: unset, e.g. no cap)."""
    from pipelinerl_jax.losses.registry import resolve_hparams  # jax import: only here
    name, extra, key = ARMS[arm]
    v = resolve_hparams(name, **extra).get(key)
    return None if v is None else float(v)


def settings(grid: Grid, reference: Optional[Grid], lag: int) -> Dict[str, dict]:
    """{arm: {"default": value, "cells": {value or DEFAULT: {seed: run}}, "default_from":
    'sweep' | 'reference' | None, "control": cell of the reference or None}}."""
    out: Dict[str, dict] = {}
    for label, cells in grid.items():
        p = parse(label)
        if p is None or lag not in cells:
            continue
        arm, value = p
        out.setdefault(arm, {"cells": {}})["cells"][value] = cells[lag]
    for arm, d in out.items():
        dv = default_value(arm)
        ref = (reference or {}).get(arm, {}).get(lag)
        d["default"], d["control"] = dv, None
        if dv is not None and dv in d["cells"]:
            d["default_from"], d["control"] = "sweep", ref
            d["cells"][DEFAULT] = d["cells"][dv]
        elif ref:
            # the reference's runs at the sweep's seeds only: every table and the figure
            # then read one set of seeds (the `''` grid ran more than the sweep)
            seeds = {s for c in d["cells"].values() for s in c}
            d["default_from"] = "reference"
            d["cells"][DEFAULT] = {s: r for s, r in ref.items() if s in seeds}
        else:
            d["default_from"] = None
    return {a: out[a] for a in ARMS if a in out}


def _pair(a: dict, b: dict, family: str, fn=final_accuracy) -> Optional[dict]:
    grid = {"a": {0: a}, "b": {0: b}}
    return protocol.contrast(grid, fn, [(1, "a", 0), (-1, "b", 0)], family)


def sensitivity(sets: Dict[str, dict], fn=final_accuracy) -> Dict[str, List[dict]]:
    """Per arm: each setting other than the default against the default (Holm within the
    arm)."""
    out = {}
    for arm, d in sets.items():
        default = d["cells"].get(DEFAULT)
        rows = []
        for value, cell in sorted((v, c) for v, c in d["cells"].items() if v != DEFAULT):
            if default is None or value == d["default"]:
                continue
            row = _pair(cell, default, f"sensitivity of {arm}", fn)
            if row:
                rows.append({"a": f"{arm} {value:g}", "lag_a": None,
                             "b": f"{arm} default ({_value(d['default'])})", "lag_b": None,
                             **row})
        out[arm] = protocol.adjust(rows)
    return out


def _value(v: Optional[float]) -> str:
    return "none" if v is None else f"{v:g}"


def control(sets: Dict[str, dict]) -> List[dict]:
    """Where the sweep and the reference both hold an arm's default: seeds shared, and runs
    identical number for number (staleness.fingerprint)."""
    rows = []
    for arm, d in sets.items():
        ref, own = d["control"], d["cells"].get(DEFAULT)
        if ref is None or own is None:
            continue
        shared = sorted(set(ref) & set(own))
        same = sum(fingerprint(own[s]) == fingerprint(ref[s]) for s in shared)
        rows.append({"arm": arm, "shared": len(shared), "identical": same})
    return rows


def best(sets: Dict[str, dict], reference_arm: str = protocol.REFERENCE_ARM,
         fn=final_accuracy) -> List[dict]:
    """Per arm: its best setting by mean, the margin over its default and over PPO-clip's
    default (seed-paired; selected on these runs: optimistic)."""
    ppo = sets.get(reference_arm, {}).get("cells", {}).get(DEFAULT)
    rows = []
    for arm, d in sets.items():
        means = {v: stats.t_interval([x for x in map(fn, c.values()) if x is not None]).mean
                 for v, c in d["cells"].items() if v != DEFAULT}
        means = {v: m for v, m in means.items() if math.isfinite(m)}
        if not means:
            continue
        v = max(means, key=means.get)
        cell = d["cells"][v]
        own = d["cells"].get(DEFAULT)
        rows.append({"arm": arm, "best": v, "mean": means[v],
                     "range": max(means.values()) - min(means.values()),
                     "vs_default": _pair(cell, own, "best vs default", fn) if own else None,
                     "vs_ppo": (_pair(cell, ppo, "best vs ppo", fn)
                                if ppo is not None and arm != reference_arm else None)})
    return rows


def _diff(row: Optional[dict], scale: float) -> str:
    if not row:
        return ""
    return (f"{row['diff'] * scale:+.1f} [{(row['diff'] - row['half']) * scale:+.1f}, "
            f"{(row['diff'] + row['half']) * scale:+.1f}]")


def section_markdown(sets: Dict[str, dict], fams: Dict[str, List[dict]], lag: int, lr: float,
                     scale: float = 100.0) -> str:
    out = [f"## The key-setting sweep (the `sweep` grid) at lag {lag}, learning rate {lr:g}", "",
           "Primary endpoint, final held-out accuracy, seed-paired. One family per loss: each "
           "setting against the loss's default (the registry's value), Holm within the loss.",
           ""]
    for arm, d in sets.items():
        src = {"sweep": "the sweep's own arm", "reference": "the `''` grid's runs; the sweep "
               "holds no arm at the default", None: "absent: no test"}[d["default_from"]]
        out += [f"### {arm}: default {_value(d['default'])} ({src})", "",
                protocol.family_markdown(fams.get(arm, []), scale), ""]
    ctl = control(sets)
    out += ["### Control: the sweep's default arms against the `''` grid's runs (same "
            "configuration, code and machine)", ""]
    if ctl:
        out += ["| loss | seeds shared | identical runs |", "|---|---|---|"]
        out += [f"| {r['arm']} | {r['shared']} | {r['identical']} |" for r in ctl]
        out += ["", "Identical: every logged step's evaluation, reward, loss and diagnostics "
                "agree to 6 significant digits. A shortfall means the runs are not "
                "reproducible run for run, and is reported, not corrected."]
    else:
        out.append("Not checked: pass the `''` grid's tables with --default_reference.")
    out += ["", "### Each loss at its best setting (selected on these runs: optimistic, "
            "descriptive, no correction)", "",
            "| loss | best setting | mean (%) | range over settings (pts) | best - default "
            "[95% CI] | best - PPO-clip default [95% CI] |", "|---|---|---|---|---|---|"]
    for r in best(sets):
        out.append(f"| {r['arm']} | {r['best']:g} | {r['mean'] * scale:.1f} | "
                   f"{r['range'] * scale:.1f} | {_diff(r['vs_default'], scale)} | "
                   f"{_diff(r['vs_ppo'], scale)} |")
    return "\n".join(out + [""])


def figure(sets: Dict[str, dict], out: str, lag: int, lr: float) -> str:
    """sweep_settings.png: per loss, final held-out accuracy (mean, 95% t-interval over
    seeds) against its key setting, the default marked (a dashed line where the default
    cell comes from the `''` grid's runs)."""
    from pipelinerl_jax.ablation.plotting import plt, save
    n = len(sets)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (arm, d) in zip(axes.flat, sets.items()):
        vals = sorted(v for v in d["cells"] if v != DEFAULT)
        ivs = [stats.t_interval([x for x in map(final_accuracy, d["cells"][v].values())
                                 if x is not None]) for v in vals]
        ax.errorbar(range(len(vals)), [iv.mean for iv in ivs],
                    yerr=[iv.half if math.isfinite(iv.half) else 0 for iv in ivs],
                    marker="o", ms=4, capsize=2)
        ax.set_xticks(range(len(vals)), [f"{v:g}" for v in vals])
        if d["default"] in vals:
            ax.axvline(vals.index(d["default"]), color="gray", ls=":", lw=1)
        elif d["default_from"] == "reference":
            iv = stats.t_interval([x for x in map(final_accuracy,
                                                  d["cells"][DEFAULT].values())
                                   if x is not None])
            ax.axhline(iv.mean, color="gray", ls="--", lw=1,
                       label=f"default ({_value(d['default'])}), from grid ''")
            ax.legend(fontsize=6)
        _, _, key = ARMS[arm]
        ax.set(title=arm, xlabel=key)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel("final held-out accuracy")
    fig.suptitle(f"key-setting sweep at lag {lag}, lr {lr:g} (mean, 95% t-interval; dotted: "
                 "the default)", fontsize=9)
    fig.tight_layout()
    return save(fig, out, "sweep_settings")
