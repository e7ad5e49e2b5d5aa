"""The protocol's `sweep` grid (ablation/sweep_grid.py, scripts/staleness_report.py) on
synthetic runs exported to committed tables: each loss's settings against its default, the
default taken from the `''` grid where the sweep holds none, and the control that the
sweep's default arms repeat the `''` grid's runs."""
import json
import os
import subprocess
import sys
import zlib

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import results, staleness, sweep_grid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402

OFFSET = {0: -0.03, 1: 0.0, 2: 0.035}
LAG = 8


def _write(root, label, loss, noise_key, drop=0.0, loss_hp=None):
    for seed in OFFSET:
        noise = 0.004 * ((zlib.crc32(f"{noise_key},{seed}".encode()) % 1001) / 500 - 1)

        def acc(s, seed=seed, noise=noise):
            return 0.30 + (0.15 - drop) * s / 40 + OFFSET[seed] + noise * (s == 40)
        synthetic.write_run(os.path.join(root, "runs", f"{label}_{seed}"), loss=loss,
                            injected=True, k=LAG, seed=seed, steps=40, lr=2e-4, acc_fn=acc,
                            labels={"loss": label, "lag": str(LAG), "seed": str(seed)},
                            loss_hp=loss_hp)


def _tables(tmp_path):
    """The sweep (ppo eps, tis cap, decoupled_ppo behaviour cap) and the `''` grid's lag-8
    arms: its ppo repeats the sweep's default ppo arm exactly, its tis does not."""
    sweep = str(tmp_path / "sweep_runs")
    for label, loss, key, drop in (
            ("ppo_eps0p1", "ppo", "ppo0.1", 0.0), ("ppo_eps0p2", "ppo", "ppo0.2", 0.0),
            ("ppo_eps0p3", "ppo", "ppo0.3", 0.10), ("tis_cap1p5", "tis", "tis1.5", 0.0),
            ("tis_cap2", "tis", "tis2", 0.0), ("tis_cap4", "tis", "tis4", 0.0),
            ("tis_cap8", "tis", "tis8", 0.0), ("decoupled_ppo_cap2", "decoupled_ppo", "d2", 0.08),
            ("decoupled_ppo_cap5", "decoupled_ppo", "d5", 0.0)):
        cap = sweep_grid.parse(label)[1] if loss == "decoupled_ppo" else None
        _write(sweep, label, loss, key, drop, loss_hp=cap and {"behave_cap": cap})
    main = str(tmp_path / "main_runs")
    for label, key in (("ppo", "ppo0.2"), ("tis", "another"), ("decoupled_ppo", "dnone")):
        _write(main, label, label, key)
    out = (str(tmp_path / "sweep"), str(tmp_path / "main"))
    results.export_tables([sweep], out[0])
    results.export_tables([main], out[1])
    return out


def test_parse_and_defaults():
    assert sweep_grid.parse("tis_cap1p5") == ("tis", 1.5)
    assert sweep_grid.parse("m2po_authors_tau0p04") == ("m2po_authors", 0.04)
    assert sweep_grid.parse("decoupled_ppo_cap5") == ("decoupled_ppo", 5.0)
    assert sweep_grid.parse("ppo") is None and sweep_grid.parse("gspo_cap2") is None
    # the registry's defaults: the values the protocol's `''` grid ran
    assert [sweep_grid.default_value(a) for a in sweep_grid.ARMS] == [0.2, 2.0, None, 2.0,
                                                                      0.04, 2.0, 8.0]


def test_settings_take_the_default_from_the_reference_where_the_sweep_has_none(tmp_path):
    sweep, main = _tables(tmp_path)
    grid = staleness.lag_grid(results.load_runs([sweep])[0])
    ref = staleness.lag_grid(results.load_runs([main])[0])
    sets = sweep_grid.settings(grid, ref, LAG)
    assert list(sets) == ["ppo", "tis", "decoupled_ppo"]
    assert sets["ppo"]["default_from"] == "sweep" and sets["ppo"]["default"] == 0.2
    assert sets["decoupled_ppo"]["default_from"] == "reference"
    assert sets["decoupled_ppo"]["cells"][sweep_grid.DEFAULT] == ref["decoupled_ppo"][LAG]
    # a reference seed the sweep did not run is left out of the default cell (the figure's
    # dashed line averaged all 32 of the `''` grid's seeds, the tables the sweep's 10)
    ref["decoupled_ppo"][LAG][99] = ref["decoupled_ppo"][LAG][0]
    assert sorted(sweep_grid.settings(grid, ref, LAG)["decoupled_ppo"]["cells"][
        sweep_grid.DEFAULT]) == sorted(OFFSET)
    assert sweep_grid.settings(grid, None, LAG)["decoupled_ppo"]["default_from"] is None
    assert {r["arm"]: (r["shared"], r["identical"]) for r in sweep_grid.control(sets)} == {
        "ppo": (3, 3), "tis": (3, 0)}


@pytest.mark.slow  # runs scripts/staleness_report.py
def test_the_report_reads_the_sweep_through_the_script(tmp_path):
    """Before 2026-12-06 the sweep's arms (`ppo_eps0p3`, ...) matched no key arm: every
    protocol family came out empty. Now one family per loss: ppo at eps 0.3 and decoupled_ppo
    at behaviour cap 2 lose against their defaults; nothing else differs."""
    sweep, main = _tables(tmp_path)
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "staleness_report.py"),
                           f"--results={sweep}", f"--default_reference={main}", f"--out={out}",
                           "--json", f"--figures={tmp_path / 'figs'}"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    js = json.loads(done.stdout.strip().splitlines()[-1])["sweep 0.0002 lag 8"]
    fam = {arm: {r["a"]: r for r in rows} for arm, rows in js["sensitivity"].items()}
    assert sorted(fam["ppo"]) == ["ppo 0.1", "ppo 0.3"] and sorted(fam["tis"]) == [
        "tis 1.5", "tis 4", "tis 8"]
    assert sorted(fam["decoupled_ppo"]) == ["decoupled_ppo 2", "decoupled_ppo 5"]
    assert fam["ppo"]["ppo 0.3"]["significant"] and fam["decoupled_ppo"]["decoupled_ppo 2"][
        "significant"]
    assert fam["ppo"]["ppo 0.3"]["diff"] == pytest.approx(-0.10, abs=0.01)
    assert not any(r["significant"] for rows in fam.values() for a, r in rows.items()
                   if a not in ("ppo 0.3", "decoupled_ppo 2"))
    assert {r["arm"]: r["identical"] for r in js["control"]} == {"ppo": 3, "tis": 0}
    best = {r["arm"]: r for r in js["best"]}
    assert best["decoupled_ppo"]["best"] == 5 and best["ppo"]["vs_ppo"] is None
    text = out.read_text()
    assert "### decoupled_ppo: default none (the `''` grid's runs; the sweep" in text
    assert "| ppo 0.3 | ppo default (0.2) | 3 | **-10." in text
    assert "| tis | 3 | 0 |" in text and "optimistic" in text
    assert (tmp_path / "figs" / "sweep_settings.png").exists()
    # no key arm and no lag 0: no empty protocol families, no vacuous ESS "prediction"
    assert "do not apply to it" in text and "Null control" not in text
    assert "Not computed: no arm of this grid ran at lag 0" in text
    assert "ESS predicted it" not in text
    # the behaviour cap travels through the committed tables (it read "uncapped" before)
    assert "`decoupled_ppo_cap2` is token IS against the behaviour policy, weight capped at 2" \
        in text
