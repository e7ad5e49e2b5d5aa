"""The staleness study's pre-registered tests: paired t-tests on one primary endpoint, Holm's
correction within each comparison family, power and minimum detectable effects.

    p = paired_p(diffs)                       # two-sided paired t-test, n-1 df
    holm([0.01, 0.04, 0.03])  ->  [0.03, 0.06, 0.06]
    power(effect=0.05, sd=0.06, n=14)         # exact, noncentral t
    mde(sd=0.06, n=14)                        # the effect detected with 80% power
    seeds_for_power(effect=0.05, sd=0.06)     # the fewest seed pairs reaching 80% power

Power is that of the two-sided paired t-test at level alpha: with n pairs and a true mean
difference d, T = mean/(s/√n) follows a noncentral t with n-1 df and noncentrality
d·√n/σ, so power = P(|T| > t_{1-alpha/2, n-1}) (Cohen 1988, ch. 2; scipy.stats.nct). The
MDE inverts it in d. `stats.min_detectable_effect` is the usual normal-style shortcut
(t quantiles added); this is the exact value, which the protocol uses.

Holm (1979): sort the m p-values, p_(1) <= ... <= p_(m); the adjusted p_(i) is
max_{j<=i} min(1, (m - j + 1)·p_(j)). Rejecting where the adjusted p < alpha controls the
family-wise error rate at alpha under any dependence between the tests, which matters here:
comparisons that share an arm or a seed are correlated. Benjamini-Hochberg controls only the
expected share of false discoveries and assumes positive dependence; the study makes a few
confirmatory claims per family, where one false claim is the error to avoid (docs/
staleness_study.md, Protocol).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

ALPHA = 0.05
POWER = 0.8


def paired_p(diffs: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test that the mean of `diffs` is 0 (nan for n < 2;
    0 or 1 when every difference is the same nonzero or zero value)."""
    d = np.asarray([x for x in diffs if x is not None and math.isfinite(x)], float)
    if d.size < 2:
        return math.nan
    sd = d.std(ddof=1)
    if sd == 0:
        return 1.0 if d.mean() == 0 else 0.0
    t = d.mean() / (sd / math.sqrt(d.size))
    return float(2 * sps.t.sf(abs(t), d.size - 1))


def holm(pvalues: Sequence[float]) -> list:
    """Holm-adjusted p-values, in the input's order (nan stays nan and is not counted)."""
    p = np.asarray(pvalues, float)
    ok = np.flatnonzero(np.isfinite(p))
    out = np.full(p.shape, math.nan)
    m = ok.size
    running = 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def power(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test with `n` pairs against a true mean difference
    `effect`, when the per-pair differences have SD `sd`."""
    if n < 2 or not (math.isfinite(sd) and sd > 0):
        return math.nan
    df = n - 1
    crit = sps.t.ppf(1 - alpha / 2, df)
    nc = abs(effect) * math.sqrt(n) / sd
    # The lower tail P(T < -crit | nc) as the upper tail of the mirrored statistic: scipy's
    # nct.cdf returns NaN far in that tail (e.g. nc 20 at 11 df), which broke `mde`'s bracket.
    return float(sps.nct.sf(crit, df, nc) + sps.nct.sf(crit, df, -nc))


def mde(sd: float, n: int, alpha: float = ALPHA, target: float = POWER) -> float:
    """The smallest true mean difference detected with power `target` (exact, noncentral t)."""
    if n < 2 or not (math.isfinite(sd) and sd > 0):
        return math.nan
    hi = sd
    while power(hi, sd, n, alpha) < target:
        hi *= 2
    return float(optimize.brentq(lambda d: power(d, sd, n, alpha) - target, 0.0, hi,
                                 xtol=1e-10 * sd))


def seeds_for_power(effect: float, sd: float, alpha: float = ALPHA, target: float = POWER,
                    most: int = 10_000) -> Optional[int]:
    """The fewest seed pairs whose paired t-test detects `effect` with power `target`."""
    if not (math.isfinite(sd) and sd > 0 and effect):
        return None
    for n in range(2, most):
        if power(effect, sd, n, alpha) >= target:
            return n
    return None


# ============================================================================ the families

# The protocol's arms and lags (docs/staleness_study.md, Protocol). Confirmatory claims are
# made on these only; every other comparison is secondary and labelled so.
KEY_ARMS = ("reinforce", "ppo", "tis", "decoupled_ppo", "staleness_clip", "m2po_authors",
            "seq_is", "vcpo")
CONFIRM_LAGS = (8, 32)
REFERENCE_ARM = "ppo"  # PPO-clip: the contrast the M2PO paper and AReaL report
# On-policy (lag 0, one minibatch) every loss of the registry takes the plain policy-gradient
# step -A·∇log π in exact arithmetic (every ratio and weight is 1, no clip binds, nothing is
# masked), except gspo, whose sequence-level objective weights tokens per sequence: it is a
# different update at every lag and stays out of the null family (it is the positive
# control: a real difference the test should find). So does vcpo as its authors ran it
# (`loss.baseline='opob'`, the default): its baseline weights each sequence's reward by its
# own gradient norm, so even on-policy its advantages are not the group's plain centring.
NOT_NULL = ("gspo", "vcpo")
# At several minibatches the later minibatches see a moved policy, so reinforce (no ratio),
# tis (a truncated ratio, no clip) and the PPO family take different updates even at lag 0.
# Within the PPO family they still agree: each clips r = pi/pi_old and weights by the
# behaviour weight pi_prox/mu, which is 1 on-policy (the proximal policy is the behaviour
# policy), so decoupled_ppo, staleness_clip (its cap on that weight never binds) and icepop
# (nothing falls outside its band) are PPO-clip. tests/learner/test_null_update.py checks
# both statements through the train step.
NULL_AT_ANY_MINIBATCHES = ("ppo", "decoupled_ppo", "staleness_clip", "icepop")


def contrast(grid, fn, terms: Sequence[tuple], family: str = "post hoc") -> Optional[dict]:
    """A seed-paired linear contrast: per seed, sum of coef * fn(run of `arm` at `lag`) over
    `terms` = [(coef, arm, lag), ...], over the seeds where every term has a finite value;
    its mean with the 95% t-interval, paired SD, raw p and MDE (None below 2 seeds)."""
    vals = [{s: fn(r) for s, r in grid.get(a, {}).get(k, {}).items()} for _, a, k in terms]
    seeds = sorted(s for s in set.intersection(*(set(v) for v in vals))
                   if all(v[s] is not None and math.isfinite(v[s]) for v in vals))
    if len(seeds) < 2:
        return None
    d = np.asarray([sum(c * v[s] for (c, _, _), v in zip(terms, vals)) for s in seeds], float)
    n, sd = d.size, float(d.std(ddof=1))
    half = float(sps.t.ppf(1 - ALPHA / 2, n - 1) * sd / math.sqrt(n))
    return {"family": family, "n": n, "diff": float(d.mean()), "half": half, "sd": sd,
            "p": paired_p(d), "mde": mde(sd, n)}


def _pair(grid, fn, a: str, ka: int, b: str, kb: int, family: str) -> Optional[dict]:
    """The seed-paired comparison of arm `a` at lag `ka` with arm `b` at lag `kb`."""
    row = contrast(grid, fn, [(1, a, ka), (-1, b, kb)], family)
    return row and {"a": a, "lag_a": ka, "b": b, "lag_b": kb, **row}


def parse_contrast(text: str) -> list:
    """'vcpo@8-vcpo@0-ppo@8+ppo@0' -> [(1, 'vcpo', 8), (-1, 'vcpo', 0), (-1, 'ppo', 8),
    (1, 'ppo', 0)]: arm@lag terms joined by + or - (ValueError naming the bad term)."""
    terms, sign, cur = [], 1, ""
    for ch in text.replace(" ", "") + "+":
        if ch in "+-" and cur:
            arm, at, lag = cur.rpartition("@")
            if not (arm and at and lag.isdigit()):
                raise ValueError(f"contrast {text!r}: term {cur!r} is not arm@lag")
            terms.append((sign, arm, int(lag)))
            sign, cur = (1 if ch == "+" else -1), ""
        elif ch in "+-":
            sign = 1 if ch == "+" else -1
        else:
            cur += ch
    if not terms:
        raise ValueError(f"contrast {text!r}: no arm@lag term")
    return terms


def adjust(rows: list) -> list:
    """`rows` (comparisons; None dropped) as one family: Holm-adjusted p, significance at 5%
    after Holm, and the MDE at the family's Bonferroni level."""
    rows = [r for r in rows if r is not None]
    for r, q in zip(rows, holm([r["p"] for r in rows])):
        r["p_holm"] = q
        r["significant"] = bool(q < ALPHA)
        # the MDE at Holm's first step (Bonferroni over the family): Holm rejects whenever
        # Bonferroni does, so every claim of the family has at least this power
        r["mde_family"] = mde(r["sd"], r["n"], alpha=ALPHA / len(rows))
    return rows


def staleness_cost(grid, fn, arms: Sequence[str], lags: Sequence[int]) -> list:
    """Family 1: each arm at each lag against the same arm at lag 0 (Holm over the family)."""
    return adjust([_pair(grid, fn, a, k, a, 0, "staleness cost") for a in arms
                      for k in lags])


def versus_reference(grid, fn, arms: Sequence[str], lags: Sequence[int],
                     reference: str = REFERENCE_ARM) -> list:
    """Family 2: each arm against PPO-clip at the same lag (Holm over the family)."""
    return adjust([_pair(grid, fn, a, k, reference, k, f"vs {reference}") for a in arms
                      if a != reference for k in lags])


def between_lags(grid, fn, arms: Sequence[str], hi: int, lo: int, family: str) -> list:
    """Each arm at lag `hi` against the same arm at lag `lo` (Holm over the arms)."""
    return adjust([_pair(grid, fn, a, hi, a, lo, family) for a in arms])


def families(grid, fn, arms: Sequence[str], lags: Sequence[int],
             reference: str = REFERENCE_ARM, own=None) -> tuple:
    """(the key arms present, as labelled in `grid`; {"null control", "staleness cost",
    "vs PPO-clip": rows}): the protocol's three families on `fn`. Arms are matched by loss
    name (a label may carry its grid's settings, `ppo (lr=5e-05)`); `own`: the grid the null
    control reads when `grid` holds lag-0 cells borrowed from another grid."""
    base = {a.split(" (")[0]: a for a in grid}
    present = [base[a] for a in arms if a in base]
    ref = base.get(reference, reference)
    return present, {"null control": null_control(grid if own is None else own, fn),
                     "staleness cost": staleness_cost(grid, fn, present, lags),
                     "vs PPO-clip": versus_reference(grid, fn, present, lags, ref)}


def null_arms(grid) -> list:
    """The arms of `grid` that take the identical update at lag 0 in exact arithmetic: at
    one minibatch every arm but `NOT_NULL`, at several the `NULL_AT_ANY_MINIBATCHES` family
    (an arm whose lag-0 runs mix minibatch counts is none)."""
    out = []
    for a in sorted(grid):
        name, k = a.split(" (")[0], _minibatches(grid[a].get(0, {}))
        if name in NOT_NULL or k is None:
            continue
        if k == 1 or name in NULL_AT_ANY_MINIBATCHES:
            out.append(a)
    return out


def _minibatches(cell) -> Optional[int]:
    """The minibatch count of a cell's runs (None: no runs, or runs that disagree)."""
    counts = {int(r.get("learner.minibatches", 1) or 1) for r in cell.values()}
    return counts.pop() if len(counts) == 1 else None


def null_control(grid, fn) -> list:
    """Family 0: every pair of `null_arms` at lag 0 with the same minibatch count. In exact
    arithmetic they are one update, so a sound test finds nothing here after Holm (their runs
    differ only by the float rounding of ratios that are 1, which the trajectories then
    amplify)."""
    k = {a: _minibatches(grid[a][0]) for a in null_arms(grid)}
    arms = list(k)
    return adjust([_pair(grid, fn, a, 0, b, 0, "null control (lag 0)")
                      for i, a in enumerate(arms) for b in arms[i + 1:] if k[a] == k[b]])


def all_pairs(grid, fn, lag: int) -> list:
    """Secondary: every pair of arms at one lag (Holm within the lag)."""
    arms = sorted(a for a in grid if lag in grid[a])
    return adjust([_pair(grid, fn, a, lag, b, lag, f"all pairs at lag {lag}")
                      for i, a in enumerate(arms) for b in arms[i + 1:]])


def planning_sd(rows: Sequence[dict]) -> float:
    """The pooled (root-mean-square) SD of the paired differences of `rows`."""
    sds = [r["sd"] for r in rows if math.isfinite(r["sd"])]
    return float(math.sqrt(np.mean(np.square(sds)))) if sds else math.nan


def _at(arm: str, lag) -> str:
    return arm if lag is None else f"{arm} @ {lag}"


def family_markdown(rows: Sequence[dict], scale: float = 100.0) -> str:
    """One row per comparison: difference with its 95% interval, MDE at 80% power, raw and
    Holm-adjusted p."""
    out = ["| a | b | seeds | a - b (pts) | 95% CI | paired SD | MDE 80% | MDE 80%, 5%/m "
           "| p | p (Holm) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "**" if r["significant"] else ""
        out.append(f"| {_at(r['a'], r['lag_a'])} | {_at(r['b'], r['lag_b'])} | {r['n']} | "
                   f"{mark}{r['diff'] * scale:+.1f}{mark} | [{(r['diff'] - r['half']) * scale:+.1f}, "
                   f"{(r['diff'] + r['half']) * scale:+.1f}] | {r['sd'] * scale:.1f} | "
                   f"{r['mde'] * scale:.1f} | {r['mde_family'] * scale:.1f} | {r['p']:.3g} | "
                   f"{r['p_holm']:.3g} |")
    sig = sum(r["significant"] for r in rows)
    out += ["", f"{len(rows)} comparisons, {sig} significant after Holm at 5% (bold). MDE: the "
                f"true difference the paired t-test detects with 80% power at 5% two-sided, "
                f"at the observed paired SD (noncentral t); at 5%/m, the same at the family's "
                f"Bonferroni level (m = {len(rows)}, Holm's first step: every claim of the family "
                f"has at least this power)."]
    return "\n".join(out) if rows else "No comparison of this family has >= 2 paired seeds."
