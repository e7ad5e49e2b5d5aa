"""Which of a grid's conclusions hold in another setting (docs/staleness_study.md, Protocol,
"External validity"; the rule stated 2026-12-06, before any run of `large` was read).

    rows = across(base_fams, other_fams)     # protocol.families of each grid, on one endpoint
    print(markdown(rows, "''", "large"))

Each comparison of the protocol's families 1 and 2 present in both grids (matched by loss
name and lags) gets one verdict, from each grid's own Holm-adjusted test:
  base significant   holds      significant in the other grid, the same sign
                     reverses   significant there, the opposite sign
                     not seen   not significant there, and there the family's MDE (80% power
                                at Holm's first level) is at most the base's |effect|: an
                                effect as large as the base's would likely have been found,
                                so it is smaller there, or absent
                     unresolved not significant there, with an MDE above the base's |effect|
  base not sig.      null in both   not significant in either
                     appears    significant only in the other grid
and `not run` where the other grid lacks the comparison. Rows come unfavourable first
(reverses, not seen, unresolved, appears, then holds, null in both, not run), as the rule
says. Each grid's null control (family 0) gates it: the protocol makes no claim of a grid
whose null control fails, so `markdown` says so above the table and marks every verdict
void (`null_control`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

FAMILIES = ("staleness cost", "vs PPO-clip")
# The order rows are printed in: the unfavourable verdicts first (the rule, 2026-12-06).
ORDER = ("reverses", "not seen", "unresolved", "appears", "holds", "null in both", "not run")


def _key(r: dict) -> tuple:
    return (r["a"].split(" (")[0], r["lag_a"], r["b"].split(" (")[0], r["lag_b"])


def verdict(base: dict, other: Optional[dict]) -> str:
    if other is None:
        return "not run"
    if base["significant"]:
        if other["significant"]:
            return "holds" if (other["diff"] > 0) == (base["diff"] > 0) else "reverses"
        return "not seen" if other["mde_family"] <= abs(base["diff"]) else "unresolved"
    return "appears" if other["significant"] else "null in both"


def across(base: Dict[str, List[dict]], other: Dict[str, List[dict]],
           families: Sequence[str] = FAMILIES) -> List[dict]:
    """One row per comparison of `base`'s families: both grids' results and the verdict,
    the unfavourable verdicts first (`ORDER`; family order within a verdict)."""
    rows = []
    for fam in families:
        there = {_key(r): r for r in other.get(fam, [])}
        for r in base.get(fam, []):
            o = there.get(_key(r))
            rows.append({"family": fam, "comparison": _key(r), "base": r, "other": o,
                         "verdict": verdict(r, o)})
    return sorted(rows, key=lambda r: ORDER.index(r["verdict"]))


def null_control(fams: Dict[str, List[dict]]) -> tuple:
    """(passes, pairs, significant after Holm) of a grid's family 0. A grid without a null
    family (no two arms that are one update at lag 0) passes vacuously with 0 pairs."""
    rows = fams.get("null control", [])
    bad = sum(bool(r["significant"]) for r in rows)
    return bad == 0, len(rows), bad


def _cell(r: Optional[dict], scale: float) -> str:
    if r is None:
        return ""
    mark = "**" if r["significant"] else ""
    return (f"{mark}{r['diff'] * scale:+.1f}{mark} [{(r['diff'] - r['half']) * scale:+.1f}, "
            f"{(r['diff'] + r['half']) * scale:+.1f}] (n {r['n']}, MDE {r['mde_family'] * scale:.1f})")


def markdown(rows: Sequence[dict], base_name: str, other_name: str, scale: float = 100.0,
             nulls: Optional[Dict[str, tuple]] = None) -> str:
    """The table; `nulls`: {grid name: null_control(its families)}, printed above it. A
    failed null control voids every verdict (the protocol makes no claim of that grid)."""
    out, failed = [], []
    for name, (ok, m, bad) in (nulls or {}).items():
        out.append(f"Null control of `{name}`: " + (
            f"passes (0 of {m} pairs significant after Holm)." if ok else
            f"**FAILS** ({bad} of {m} pairs significant after Holm): no claim of `{name}` is "
            f"made, and every verdict below is void."))
        if not ok:
            failed.append(name)
    out += [""] if out else []
    out += [f"| family | comparison | {base_name} | {other_name} | verdict |",
            "|---|---|---|---|---|"]
    for r in rows:
        a, ka, b, kb = r["comparison"]
        v = f"void ({r['verdict']})" if failed else r["verdict"]
        out.append(f"| {r['family']} | {a} @ {ka} - {b} @ {kb} | {_cell(r['base'], scale)} | "
                   f"{_cell(r['other'], scale)} | {v} |")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ORDER}
    out += ["", "Verdicts: " + ", ".join(f"{v} {n}" for v, n in counts.items() if n) + ". "
            "Each cell: the difference in points with its 95% interval, seeds, and the MDE at "
            "80% power at the family's Holm first level; **bold**: significant after Holm "
            "within that grid's family. The rule (ablation/validity.py): holds / reverses = "
            "significant in both, same / opposite sign; not seen = significant in the first, "
            "not in the second though its MDE is at most the first's effect; unresolved = "
            "not significant in the second, MDE above the first's effect; null in both; "
            "appears = significant only in the second."]
    return "\n".join(out)
