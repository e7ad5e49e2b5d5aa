"""Which conclusions of one grid hold in another (ablation/validity.py,
scripts/staleness_validity.py): every verdict of the rule, and the script on synthetic
committed tables."""
import json
import os
import subprocess
import sys
import zlib

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import results, validity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402

OFFSET = {0: -0.03, 1: 0.0, 2: 0.035, 3: 0.01}


def _row(diff, sig, mde=0.05):
    return {"a": "tis", "lag_a": 8, "b": "tis", "lag_b": 0, "diff": diff, "significant": sig,
            "mde_family": mde, "half": 0.01, "n": 4}


@pytest.mark.parametrize("base,other,want", [
    (_row(-0.1, True), _row(-0.05, True), "holds"),
    (_row(-0.1, True), _row(+0.05, True), "reverses"),
    (_row(-0.1, True), _row(-0.01, False, mde=0.08), "not seen"),
    (_row(-0.1, True), _row(-0.01, False, mde=0.12), "unresolved"),
    (_row(-0.01, False), _row(0.0, False), "null in both"),
    (_row(-0.01, False), _row(-0.2, True), "appears"),
    (_row(-0.1, True), None, "not run")])
def test_every_verdict(base, other, want):
    assert validity.verdict(base, other) == want


def test_rows_come_unfavourable_first_and_a_failed_null_control_voids_them():
    fam = {"staleness cost": [dict(_row(-0.1, True), lag_a=k) for k in (8, 16, 32, 64)],
           "null control": [dict(_row(0.0, False), lag_a=0)]}
    other = {"staleness cost": [dict(_row(-0.1, True), lag_a=8),  # holds
                                dict(_row(+0.1, True), lag_a=16),  # reverses
                                dict(_row(0.0, False, mde=0.5), lag_a=32)],  # unresolved
             "null control": [dict(_row(0.03, True), lag_a=0)]}
    rows = validity.across(fam, other)
    assert [(r["verdict"], r["comparison"][1]) for r in rows] == [
        ("reverses", 16), ("unresolved", 32), ("holds", 8), ("not run", 64)]
    assert validity.null_control(fam) == (True, 1, 0)
    assert validity.null_control(other) == (False, 1, 1)
    text = validity.markdown(rows, "a", "b", nulls={"a": validity.null_control(fam),
                                                    "b": validity.null_control(other)})
    assert "Null control of `a`: passes" in text
    assert "Null control of `b`: **FAILS** (1 of 1 pairs" in text
    assert "| void (reverses) |" in text and "| holds |" not in text
    assert "| holds |" in validity.markdown(rows, "a", "b")


def _tables(root, out, arms, tag, steps=40):
    """arms: {label: {lag: drop}} x seeds 0-3 -> committed tables at `out`; the noise (none
    at lag 0) is a function of `tag`, the arm, lag and seed only (never of a temporary path), so every
    run of the test sees the same numbers."""
    for label, lags in arms.items():
        for k, drop in lags.items():
            for seed in OFFSET:
                # none at lag 0: there the arms are one update (the null control passes)
                noise = 0.003 * ((zlib.crc32(f"{tag},{label},{k},{seed}".encode()) % 1001)
                                 / 500 - 1) * (k > 0)

                def acc(s, seed=seed, drop=drop, noise=noise):
                    return 0.30 + (0.15 - drop) * s / steps + OFFSET[seed] + noise * (s == steps)
                synthetic.write_run(os.path.join(root, "runs", f"{label}_{k}_{seed}"),
                                    loss=label, injected=True, k=k, seed=seed, steps=steps,
                                    lr=2e-4, acc_fn=acc,
                                    labels={"loss": label, "lag": str(k), "seed": str(seed)})
    results.export_tables([root], out)
    return out


@pytest.mark.slow  # runs scripts/staleness_validity.py
def test_the_script_carries_each_conclusion_across(tmp_path):
    """tis loses 5 points at lag 8 in both grids (holds) and 8 at lag 32 in the first but
    gains 8 in the second (reverses); ppo loses nothing in the first and 6 at lag 8 in the
    second (appears); m2po ran only in the first (not run)."""
    base = _tables(str(tmp_path / "b"), str(tmp_path / "main"), {
        "tis": {0: 0, 8: 0.05, 32: 0.08}, "ppo": {0: 0, 8: 0, 32: 0},
        "m2po_authors": {0: 0, 8: 0.05}}, "base")
    other = _tables(str(tmp_path / "o"), str(tmp_path / "large"), {
        "tis": {0: 0, 8: 0.05, 32: -0.08}, "ppo": {0: 0, 8: 0.06, 32: 0}}, "other", steps=60)
    out = tmp_path / "validity.md"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts",
                                                        "staleness_validity.py"),
                           f"--base={base}", f"--other={other}", f"--out={out}", "--json",
                           "--confirm_arms=ppo,tis,m2po_authors"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    got = {(r["family"], *r["comparison"]): r["verdict"] for r in rows}
    assert got[("staleness cost", "tis", 8, "tis", 0)] == "holds"
    assert got[("staleness cost", "tis", 32, "tis", 0)] == "reverses"
    assert got[("staleness cost", "ppo", 8, "ppo", 0)] == "appears"
    assert got[("staleness cost", "ppo", 32, "ppo", 0)] == "null in both"
    assert got[("staleness cost", "m2po_authors", 8, "m2po_authors", 0)] == "not run"
    assert got[("vs PPO-clip", "tis", 32, "ppo", 32)] == "reverses"
    assert [r["verdict"] for r in rows][:2] == ["reverses", "reverses"]  # unfavourable first
    assert not any(r["void"] for r in rows)
    text = out.read_text()
    assert "## Which conclusions of `main` hold in `large` (learning rate 0.0002" in text
    assert "Null control of `main`: passes (0 of 3 pairs" in text
    assert "Null control of `large`: passes (0 of 1 pairs" in text
    assert "| staleness cost | tis @ 8 - tis @ 0 | **-5." in text
