"""Published staleness phenomena, each measured on our runs and given a verdict.

    runs, _ = results.load_runs(["runs/repro_tinker", "results/staleness"])
    v = verdict("tinker_kl", runs)    # {"rows": side-by-side numbers, "verdict", "rule", ...}

Runs are picked by their config, not their directory (so one phenomenon may read cells of
the full staleness grid and of its own repro grid, configs/repro/*.py); a phenomenon's
claims are each checked with the seed-paired 95% t-interval of stats.py, and the verdict is
'reproduced' when every claim holds, 'partly' when some do, 'not' when none does (or
'insufficient data' when a cell it needs is missing).

A verdict holds in a regime: `verdicts(name, runs)` judges the phenomenon once per learning
rate among its runs (the staleness study runs 2e-4 and the drift subgrid's 5e-5, where one
version moves the policy ~an order of magnitude less), never pooling the two. Within one
regime an arm, lag and seed is one run: two differently named runs there (e.g. two forms of
one loss that the arm's rule failed to tell apart) are an error, not a silent replacement.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipelinerl_jax.ablation import stats
from pipelinerl_jax.ablation.results import Run, summarize_run
from pipelinerl_jax.ablation.staleness import (Grid, by_learning_rate, cell_interval,
                                               collapsed_runs, per_seed, versus)

UNCAPPED = 1e3  # a tis cap at or above this never binds here: unclipped importance weighting
KL_WINDOW = 10  # steps averaged for the early and late KL


@dataclasses.dataclass(frozen=True)
class Phenomenon:
    title: str
    source: str
    published: str
    classify: Callable[[Run], Optional[str]]  # run -> the arm it belongs to, or None
    measure: Callable[[Grid], dict]


def _minibatches(r: Run) -> int:
    return int(r.get("learner.minibatches", 1) or 1)


def _cap(r: Run) -> float:
    cap = r.get("loss.cap")
    return 2.0 if cap is None else float(cap)  # None: the registry's default


def _tinker_arm(r: Run) -> Optional[str]:
    if _minibatches(r) != 1:
        return None
    name = r.get("loss.name")
    if name == "tis" and _cap(r) >= UNCAPPED:
        return "unclipped_is"
    return "ppo" if name == "ppo" else None


def _m2po_arm(r: Run, long: bool = False) -> Optional[str]:
    """m2po in the paper's form (`m2po`), in the released code's (`m2po_released` with the clip
    floor, `m2po_authors` without it, as the authors' scripts run it), or capped
    tis; one minibatch; `long`: only the `:long` grid's runs (labelled steps=N), else only
    runs without that axis (a 160-step run must not pool with, or replace, the 60-step grid's
    run of the same loss, lag and seed)."""
    name = r.get("loss.name")
    if _minibatches(r) != 1 or name not in ("m2po", "tis"):
        return None
    if name == "tis" and _cap(r) >= UNCAPPED:
        return None
    if ("steps" in (r.labels or {})) != long:
        return None
    if name == "m2po" and r.get("loss.form") == "released":
        # the authors' form (no clip floor) and the floored one are two arms (their labels)
        return "m2po_authors" if (r.labels or {}).get("loss") == "m2po_authors" \
            else "m2po_released"
    return name


def _m2po_long_arm(r: Run) -> Optional[str]:
    return _m2po_arm(r, long=True)


def _decoupled_arm(r: Run) -> Optional[str]:
    name = r.get("loss.name")
    if _minibatches(r) > 1 and name in ("decoupled_ppo", "ppo"):
        return f"{name} (minibatches={_minibatches(r)})"
    return None


# ---------------------------------------------------------------------------- measures

def kl_growth(r: Run, window: int = KL_WINDOW) -> Dict[str, Optional[float]]:
    """KL(behaviour || current) k3 of the run: the mean of its first `window` steps with the
    full injected lag (step > k) and of its last `window` steps, and their ratio."""
    k = int(r.get("lag_injection.k", 0))
    s, _, v = r.series("loss/kl_k3")
    v = v[(s > k) & np.isfinite(v)]
    if v.size < 2 * window:
        window = v.size // 2
    if window == 0:
        return {"early": None, "late": None, "growth": None}
    early, late = float(v[:window].mean()), float(v[-window:].mean())
    return {"early": early, "late": late, "growth": late / early if early > 0 else None}


def _geo(values) -> stats.Interval:
    """Interval of log10 values, reported back as 10**(mean), [10**lo, 10**hi]."""
    logs = [math.log10(v) for v in values if v is not None and v > 0]
    return stats.t_interval(logs)


def _pow(iv: stats.Interval) -> str:
    if iv.n == 0:
        return "n/a"
    if not math.isfinite(iv.half):
        return f"{10 ** iv.mean:.3g}x"
    return f"{10 ** iv.mean:.3g}x [{10 ** iv.lo:.3g}, {10 ** iv.hi:.3g}]"


def _acc_row(grid: Grid, arm: str, lag: int) -> dict:
    cell, ref = grid[arm][lag], grid[arm].get(0)
    iv = cell_interval(cell)
    row = {"arm": arm, "lag": lag, "seeds": iv.n, "final_accuracy": iv.text(100) + "%"}
    if ref is not None and lag:
        c = versus(cell, ref)
        row["vs_lag0"] = f"{100 * c.diff:+.1f} ± {100 * c.half:.1f} pts ({c.verdict})"
        row["_cmp"] = c
    return row


def _missing(grid: Grid, need: Dict[str, Sequence[int]]) -> List[str]:
    return [f"{arm} at lag {k}" for arm, lags in need.items() for k in lags
            if k not in grid.get(arm, {})]


def measure_tinker(grid: Grid) -> dict:
    lags = sorted(k for k in grid.get("unclipped_is", {}) if k > 0)
    k = 3 if 3 in lags else (lags[0] if lags else 3)
    missing = _missing(grid, {"unclipped_is": (0, k), "ppo": (0, k)})
    if missing:
        return {"missing": missing}
    rows, claims = [], {}
    growth = {}
    for arm in ("unclipped_is", "ppo"):
        for lag in (0, k):
            row = _acc_row(grid, arm, lag)
            kls = per_seed(grid[arm][lag], kl_growth)
            row["kl_early"] = _mean([x["early"] for x in kls.values()])
            row["kl_late"] = _mean([x["late"] for x in kls.values()])
            g = _geo([x["growth"] for x in kls.values()])
            row["kl_growth_late_over_early"] = _pow(g)
            if lag:
                late0 = per_seed(grid[arm][0], lambda r: kl_growth(r)["late"])
                row["kl_late_over_lag0"] = _pow(_geo(
                    [kls[s]["late"] / late0[s] for s in kls if late0.get(s)]))
                growth[arm] = g
            rows.append(row)
    kl_u = per_seed(grid["unclipped_is"][k], lambda r: kl_growth(r)["late"])
    kl_p = per_seed(grid["ppo"][k], lambda r: kl_growth(r)["late"])
    ratio = _geo([kl_u[s] / kl_p[s] for s in kl_u if kl_p.get(s)])
    drop_u = next(r["_cmp"] for r in rows if r["arm"] == "unclipped_is" and r["lag"] == k)
    drop_p = next(r["_cmp"] for r in rows if r["arm"] == "ppo" and r["lag"] == k)
    g_u, g_p = growth["unclipped_is"], growth["ppo"]
    claims["unclipped IS: KL grows > 10x over the run"] = bool(g_u.n and 10 ** g_u.mean > 10)
    claims["unclipped IS: final accuracy significantly below its lag 0"] = \
        drop_u.verdict == "worse"
    claims["ppo: no significant drop and KL growth < 10x"] = \
        drop_p.verdict != "worse" and bool(g_p.n and 10 ** g_p.mean < 10)
    # PPO's stability is the control: it alone does not make the phenomenon partly seen.
    return {"lag": k, "rows": rows, "claims": claims, "core": list(claims)[:2],
            "extra": {"late KL unclipped / ppo at lag k": _pow(ratio)}}


def _mean(values) -> Optional[float]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def _drift_flagged(cell: Dict[int, Run]) -> int:
    return sum(bool(summarize_run(r, None)["drift_flag"]) for r in cell.values())


M2PO_FORMS = ("m2po", "m2po_released", "m2po_authors")


def measure_m2po(grid: Grid) -> dict:
    """Each m2po form present (the paper's, the released code's) against capped tis at the
    largest lag >= 32 they share: the form shows no significant drop and no collapsed run
    there; tis falls below its lag 0 or below every form present."""
    forms = [f for f in M2PO_FORMS if f in grid]
    lags = sorted(set(grid.get("tis", {})).intersection(*[set(grid[f]) for f in forms])) \
        if forms else []
    big = [k for k in lags if k >= 32] or [k for k in lags if k > 0]
    missing = (_missing(grid, {f: (0,) for f in forms or ["m2po"]}) + _missing(grid, {"tis": (0,)})
               + ([] if big else ["a lag >= 32"]))
    if missing:
        return {"missing": missing}
    k = max(big)
    rows = [_acc_row(grid, arm, lag) for arm in forms + ["tis"] for lag in lags]
    for row in rows:
        row["collapsed_runs"] = collapsed_runs(grid[row["arm"]][row["lag"]].values())
        row["drift_flagged_runs"] = _drift_flagged(grid[row["arm"]][row["lag"]])
    at_k = {row["arm"]: row for row in rows if row["lag"] == k}
    heads = {f: versus(grid[f][k], grid["tis"][k]) for f in forms}
    claims = {f"{f} at lag {k}: no significant drop vs lag 0, no collapsed run":
              at_k[f]["_cmp"].verdict != "worse" and at_k[f]["collapsed_runs"] == 0
              for f in forms}
    claims[f"tis at lag {k}: significantly below its lag 0 or below "
           f"{' and '.join(forms)} at lag {k}"] = \
        at_k["tis"]["_cmp"].verdict == "worse" or all(h.verdict == "better"
                                                       for h in heads.values())
    extra = {f"{f} - tis at lag {k}": f"{100 * h.diff:+.1f} ± {100 * h.half:.1f} pts "
                                      f"({h.verdict})" for f, h in heads.items()}
    if "m2po" in forms and "m2po_released" in forms:
        c = versus(grid["m2po_released"][k], grid["m2po"][k])
        extra[f"m2po_released - m2po at lag {k}"] = (f"{100 * c.diff:+.1f} ± {100 * c.half:.1f}"
                                                     f" pts ({c.verdict})")
    steps = min(int(r.get("learner.total_steps", 0)) for f in forms for r in grid[f][k].values())
    if steps <= k:
        extra["warning"] = f"runs of {steps} steps never train at lag {k} (lag = min(k, step))"
    return {"lag": k, "rows": rows, "claims": claims, "extra": extra}


def tolerance(by_lag: Dict[int, Dict[int, Run]]) -> Optional[int]:
    """The largest lag L such that no lag <= L is significantly below lag 0."""
    if 0 not in by_lag:
        return None
    tol = 0
    for k in sorted(by_lag):
        if k and versus(by_lag[k], by_lag[0]).verdict == "worse":
            break
        tol = k
    return tol


def measure_decoupled(grid: Grid) -> dict:
    arms = sorted(grid)
    dec = [a for a in arms if a.startswith("decoupled_ppo")]
    ppo = [a for a in arms if a.startswith("ppo")]
    pairs = [(d, p) for d in dec for p in ppo if d.split(" ", 1)[1] == p.split(" ", 1)[1]]
    if not pairs:
        return {"missing": ["decoupled_ppo and ppo with the same learner.minibatches > 1"]}
    d, p = pairs[0]
    missing = _missing(grid, {d: (0,), p: (0,)})
    if missing:
        return {"missing": missing}
    lags = sorted(set(grid[d]) & set(grid[p]))
    rows = [_acc_row(grid, arm, k) for arm in (d, p) for k in lags]
    heads = {k: versus(grid[d][k], grid[p][k]) for k in lags if k}
    t_d, t_p = tolerance(grid[d]), tolerance(grid[p])
    claims = {"decoupled PPO tolerates a larger lag than PPO": t_d > t_p,
              "decoupled PPO tolerates lag >= 4 without a significant drop": t_d >= 4}
    extra = {"tolerated lag (largest L with no significant drop at any lag <= L)":
             f"decoupled {t_d}, ppo {t_p} (of lags {lags})"}
    extra.update({f"decoupled - ppo at lag {k}": f"{100 * c.diff:+.1f} ± {100 * c.half:.1f} "
                  f"pts ({c.verdict})" for k, c in heads.items()})
    return {"rows": rows, "claims": claims, "extra": extra,
            "better_somewhere": any(c.verdict == "better" for c in heads.values())}


PHENOMENA = {
    "tinker_kl": Phenomenon(
        "Unclipped importance weighting at staleness ~3 vs PPO clipping",
        "tinker-cookbook async RL discussion",
        "unclipped IS at K=3: sampler-trainer KL grows ~30x and training degrades; "
        "PPO-clipped loss stays stable", _tinker_arm, measure_tinker),
    "m2po_stale": Phenomenon(
        "M2PO stays stable on very stale data; truncated IS degrades",
        "M2PO, arXiv 2510.01161",
        "M2PO trains stably with data >= 256 versions stale, matching on-policy accuracy; "
        "plain truncated IS degrades", _m2po_arm, measure_m2po),
    "m2po_stale_long": Phenomenon(
        "M2PO stays stable on very stale data; truncated IS degrades (lag 64, 160 steps)",
        "M2PO, arXiv 2510.01161",
        "M2PO trains stably with data >= 256 versions stale, matching on-policy accuracy; "
        "plain truncated IS degrades", _m2po_long_arm, measure_m2po),
    "decoupled_ppo": Phenomenon(
        "Decoupled PPO (proximal policy) tolerates more staleness than PPO",
        "AReaL, arXiv 2505.24298",
        "decoupled PPO keeps accuracy up to staleness ~4-8 (eta sweep); standard PPO degrades "
        "sooner", _decoupled_arm, measure_decoupled),
}

RULE = ("reproduced: every claim holds; partly: some do (for tinker_kl, one of the two about "
        "unclipped IS: PPO's stability is the control); not: otherwise. A drop or a "
        "difference counts only when the seed-paired 95% t-interval of the difference in "
        "final held-out accuracy excludes 0 (n = seeds, n-1 df).")


def arm_grids(name: str, runs: Sequence[Run]) -> Dict[float, Grid]:
    """{learning rate: {arm: {lag: {seed: run}}}} of the runs phenomenon `name` picks, in
    increasing order of learning rate (two differently named runs in one slot: ValueError)."""
    if name not in PHENOMENA:
        raise KeyError(f"unknown phenomenon {name!r}; valid: {sorted(PHENOMENA)}")
    try:
        return by_learning_rate(runs, key=PHENOMENA[name].classify)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def regimes(name: str, runs: Sequence[Run]) -> List[Tuple[Grid, dict]]:
    """(grid, verdict) per learning rate among the runs of `name` (see RULE), each verdict
    carrying its `learning_rate` and `regime`; one 'insufficient data' verdict, on an empty
    grid, when no run is the phenomenon's."""
    grids = arm_grids(name, runs)
    if not grids:
        return [({}, _judge(name, {}))]
    return [(grid, dict(_judge(name, grid), learning_rate=lr, regime=f"lr={lr:g}"))
            for lr, grid in grids.items()]


def _judge(name: str, grid: Grid) -> dict:
    ph = PHENOMENA[name]
    m = ph.measure(grid)
    out = {"name": name, "title": ph.title, "source": ph.source, "published": ph.published,
           "rule": RULE}
    if "missing" in m:
        out.update(verdict="insufficient data", missing=m["missing"])
        return out
    core = m.pop("core", list(m["claims"]))
    v = "reproduced" if all(m["claims"].values()) else \
        "partly" if any(m["claims"][c] for c in core) else "not"
    if name == "decoupled_ppo" and v == "not" and m.get("better_somewhere"):
        v = "partly"
    for row in m["rows"]:
        row.pop("_cmp", None)
    out.update(verdict=v, **{k: val for k, val in m.items() if k != "better_somewhere"})
    return out


def verdicts(name: str, runs: Sequence[Run]) -> List[dict]:
    """Phenomenon `name` judged once per learning rate among its runs (`regimes`)."""
    return [v for _, v in regimes(name, runs)]


def verdict(name: str, runs: Sequence[Run]) -> dict:
    """The verdict of `name` on runs of one learning rate (`verdicts` for several)."""
    vs = verdicts(name, runs)
    if len(vs) > 1:
        raise ValueError(f"{name}: runs at {len(vs)} learning rates "
                         f"({', '.join(v['regime'] for v in vs)}): use verdicts()")
    return vs[0]


def verdict_text(v: dict) -> str:
    """The verdict as plain text: our numbers beside the published claim, claims, verdict."""
    regime = f", {v['regime']}" if "regime" in v else ""
    lines = [f"# {v['title']} ({v['name']}{regime})",
             f"published ({v['source']}): {v['published']}"]
    if "missing" in v:
        return "\n".join(lines + [f"verdict: {v['verdict']} (missing: "
                                  f"{', '.join(v['missing'])})"])
    cols = []
    for row in v["rows"]:
        cols += [c for c in row if c not in cols]
    lines.append("ours:")
    lines.append("  " + " | ".join(cols))
    for row in v["rows"]:
        lines.append("  " + " | ".join(_fmt(row.get(c)) for c in cols))
    for k, val in v.get("extra", {}).items():
        lines.append(f"  {k}: {val}")
    lines.append("claims:")
    lines += [f"  [{'x' if ok else ' '}] {c}" for c, ok in v["claims"].items()]
    lines += [f"verdict: {v['verdict']}", f"rule: {v['rule']}"]
    return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)
