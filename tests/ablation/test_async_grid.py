"""The protocol's `async` grid (ablation/async_grid.py, scripts/staleness_report.py) on
synthetic runs exported to committed tables: real asynchronous runs keyed by their bound,
each arm's synchronous reference taken from the lag-injected tables, the two families, and
the lags the runs trained on reported as an outcome."""
import json
import os
import subprocess
import sys
import zlib

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import async_grid, results

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402

SEEDS = (0, 1, 2, 3)
OFFSET = {0: -0.03, 1: 0.0, 2: 0.035, 3: 0.01}  # seed spread larger than the effects
ARMS = ("ppo", "decoupled_ppo", "staleness_clip")
LR = 5e-5


def _acc(tag, seed, drop):
    noise = 0.004 * ((zlib.crc32(tag.encode()) % 1001) / 500 - 1)
    return lambda s: 0.30 + (0.15 - drop) * s / 12 + OFFSET[seed] + noise * (s == 12)


def _write(tmp_path, drops, lags, sync=True):
    """Async runs of ARMS x bounds {4, 16} x SEEDS (accuracy drop `drops[(arm, bound)]`,
    every token at lag `lags[(arm, bound)]`), exported to a table folder; with `sync`, the
    arms' in-process lag-0 runs (the mb4 grid's reference) to another. -> (async, sync)."""
    root = tmp_path / "async_runs"
    for a in ARMS:
        for m in (4, 16):
            for s in SEEDS:
                labels = {"loss": a, "max_lag": str(m), "minibatches": "4", "seed": str(s)}
                synthetic.write_run(str(root / "runs" / f"{a}_{m}_{s}"), mode="async",
                                    max_lag=m, loss=a, seed=s, minibatches=4, lr=LR,
                                    lag=lags.get((a, m), 2), labels=labels,
                                    acc_fn=_acc(f"{a},{m},{s}", s, drops.get((a, m), 0.0)))
    out = tmp_path / "async"
    results.export_tables([str(root)], str(out))
    if not sync:
        return str(out), None
    sroot = tmp_path / "sync_runs"
    for a in ARMS + ("tis",):
        for s in SEEDS:
            mb = "1" if a == "tis" else "4"  # tis: another label, never a reference here
            for k in (0, 8):
                labels = {"loss": a, "lag": str(k), "minibatches": mb, "seed": str(s)}
                synthetic.write_run(str(sroot / "runs" / f"{a}_{k}_{s}"), loss=a,
                                    injected=True, k=k, seed=s, minibatches=int(mb), lr=LR,
                                    labels=labels, acc_fn=_acc(f"{a},sync{k},{s}", s, 0.0))
    sync_out = tmp_path / "mb4"
    results.export_tables([str(sroot)], str(sync_out))
    return str(out), str(sync_out)


def test_async_grid_keys_runs_by_bound_with_the_synchronous_reference(tmp_path):
    folder, sync = _write(tmp_path, {}, {("ppo", 16): 7})
    runs, problems = results.load_runs([folder, sync])
    assert not problems
    grids = async_grid.async_grids(runs)
    assert list(grids) == [LR]
    grid = grids[LR]
    assert sorted(grid) == [f"{a} (minibatches=4)" for a in sorted(ARMS)]  # no tis
    assert all(sorted(c) == [0, 4, 16] and all(len(c[k]) == 4 for k in c)
               for c in grid.values())
    ref = grid["ppo (minibatches=4)"][0][2]
    assert ref.get("lag_injection.enabled") and ref.get("lag_injection.k") == 0  # not lag 8
    assert async_grid.bounds(grid) == [4, 16]
    lag = async_grid.realized_lag(grid["ppo (minibatches=4)"][16][1])
    assert lag["mean"] == 7 and lag["at0"] == 0 and lag["max"] == 7
    # without the reference only the bounds; lag-injected runs alone are no async grid
    assert sorted(async_grid.async_grids(results.load_runs([folder])[0])[LR]["ppo (minibatches=4)"]) == [4, 16]
    assert async_grid.async_grids(results.load_runs([sync])[0]) == {}
    # two differently named runs in one slot: an error naming both
    twin = results.load_runs([folder])[0]
    clash = [r for r in twin if r.name.startswith("loss=ppo,max_lag=4,")][0]
    clash.name = "another"
    with pytest.raises(ValueError, match="another"):
        async_grid.async_grids(runs + [clash])


def _report(tmp_path, folder, sync, out):
    args = [sys.executable, os.path.join(ROOT, "scripts", "staleness_report.py"),
            f"--results={folder}", f"--out={out}", "--json", f"--figures={tmp_path / 'figs'}",
            "--confirm_arms=decoupled_ppo,ppo,staleness_clip"]
    if sync:
        args.append(f"--sync_reference={sync}")
    done = subprocess.run(args, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # runs scripts/staleness_report.py
def test_the_report_reads_the_async_grid_through_the_script(tmp_path):
    """Before 2026-12-06 the report read only lag-injected runs and stopped on the async
    grid's tables ("no lag-injected runs"). Now: staleness_clip loses 10 points at bound 16
    and trains on staler tokens than PPO-clip there; the others lose nothing."""
    folder, sync = _write(tmp_path, {("staleness_clip", 16): 0.10},
                          {("ppo", 16): 6, ("decoupled_ppo", 16): 6, ("staleness_clip", 16): 9})
    out = tmp_path / "report.md"
    fams = _report(tmp_path, folder, sync, out)[f"async {LR:g}"]
    cost = {(r["a"].split(" (")[0], r["lag_a"]): r for r in fams["cost of asynchrony"]}
    assert sorted(cost) == sorted((a, m) for a in ARMS for m in (4, 16))
    assert all(r["lag_b"] == 0 and r["n"] == 4 for r in cost.values())
    assert cost[("staleness_clip", 16)]["significant"]
    assert cost[("staleness_clip", 16)]["diff"] == pytest.approx(-0.10, abs=0.01)
    assert not any(r["significant"] for k, r in cost.items() if k != ("staleness_clip", 16))
    vs = {(r["a"].split(" (")[0], r["lag_a"]): r for r in fams["vs PPO-clip"]}
    assert sorted(vs) == sorted((a, m) for a in ("decoupled_ppo", "staleness_clip")
                                for m in (4, 16))
    assert vs[("staleness_clip", 16)]["significant"] and not vs[("decoupled_ppo", 16)]["significant"]
    assert len(fams["largest vs smallest bound"]) == 3 and len(fams["all pairs at bound 4"]) == 3
    text = out.read_text()
    assert "## Real asynchronous runs (the `async` grid), learning rate 5e-05" in text
    assert (tmp_path / "figs" / "async_bounds.png").exists()
    assert "# Secondary analyses" not in text  # no lag-injected runs: no empty heading
    assert "| staleness_clip (minibatches=4) | 16 | 4 |" in text  # the outcome table
    balance = [x for x in text.splitlines() if x.startswith("| staleness_clip (minibatches=4)"
                                                            " | ppo (minibatches=4) | 16 |")]
    assert len(balance) == 1 and "+3.00" in balance[0] and "differs" in balance[0]
    assert "| decoupled_ppo (minibatches=4) | ppo (minibatches=4) | 16 | 4 | +0.00 |" in text
    # without the reference: A2 whole, A1 empty and said so
    fams = _report(tmp_path, folder, None, tmp_path / "r2.md")[f"async {LR:g}"]
    assert fams["cost of asynchrony"] == [] and len(fams["vs PPO-clip"]) == 4
    assert "not among the runs given" in (tmp_path / "r2.md").read_text()
