"""The staleness study's tables (staleness.py) and the repro verdicts (repro.py,
scripts/repro_verdict.py) on synthetic runs exported to committed tables (CSV), so the
whole path CSV -> runs -> verdict is what is tested."""
import dataclasses
import json
import os
import subprocess
import sys
import zlib

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import repro, results, staleness

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic  # noqa: E402

SEED_OFFSET = {0: -0.03, 1: 0.0, 2: 0.035}  # seed-to-seed spread larger than the effects


def _run(root, label, loss, k, seed, drop=0.0, kl=(0.01, 0.01), ess=1.0, axes=None, **extra):
    """A 40-step injected run: final accuracy 0.45 + the seed's offset - drop (+ tiny
    noise), KL k3 from kl[0] to kl[1] after step k, stalest-bucket ESS `ess`; `axes`: more
    grid labels (e.g. {"steps": "160"})."""
    axes = axes or {}
    noise = 0.006 * ((zlib.crc32(f"{label},{k},{seed}".encode()) % 1001) / 500 - 1)

    def acc(s):
        return 0.30 + (0.15 - drop) * s / 40 + SEED_OFFSET[seed] + noise * (s == 40)

    def klf(s):
        f = min(max(s - k, 0) / (40 - k), 1.0)
        return kl[0] * (kl[1] / kl[0]) ** f

    tag = "".join(f"_{a}{b}" for a, b in sorted(axes.items()))
    synthetic.write_run(os.path.join(root, "runs", f"{label}{tag}_{k}_{seed}"), loss=loss,
                        injected=True, k=k, seed=seed, steps=40, acc_fn=acc, kl_fn=klf,
                        ess_fn=lambda s: ess, **extra,
                        labels={"loss": label, "lag": str(k), "seed": str(seed), **axes})


def _tables(tmp_path, arms):
    """arms: [(label, loss, {lag: dict(drop=, kl=, ess=)}, extra)] x seeds 0-2 -> CSV dir."""
    root = str(tmp_path / "grid")
    for label, loss, lags, extra in arms:
        for k, kw in lags.items():
            for seed in (0, 1, 2):
                _run(root, label, loss, k, seed, **kw, **extra)
    out = str(tmp_path / "tables")
    results.export_tables([root], out)
    return out


def _verdict(name, folder):
    runs, problems = results.load_runs([folder])
    assert not problems and runs and all(r.path == os.path.abspath(folder) for r in runs)
    return repro.verdict(name, runs)


def test_tinker_kl_reproduced_partly_not(tmp_path):
    grow = {0: {}, 3: dict(drop=0.08, kl=(0.01, 0.3))}  # 30x late/early, 8 points down
    flat = {0: {}, 3: dict(kl=(0.01, 0.012))}
    cases = {"reproduced": grow, "partly": {0: {}, 3: dict(drop=0.08)}, "not": flat}
    for want, unclipped in cases.items():
        folder = _tables(tmp_path / want, [("tis_nocap", "tis", unclipped, {"cap": 1e6}),
                                           ("ppo", "ppo", flat, {})])
        v = _verdict("tinker_kl", folder)
        assert v["verdict"] == want, repro.verdict_text(v)
    assert v["lag"] == 3
    text = repro.verdict_text(_verdict("tinker_kl", str(tmp_path / "reproduced" / "tables")))
    assert "verdict: reproduced" in text
    assert any(x.startswith("  unclipped_is | 3 | 3 |") and "pts (worse)" in x
               for x in text.splitlines()), text
    assert "KL ~30x" not in text and "grows ~30x" in text  # the published claim, side by side


def test_m2po_and_decoupled_verdicts(tmp_path):
    folder = _tables(tmp_path / "m2po", [
        ("m2po", "m2po", {0: {}, 32: dict(drop=0.005)}, {}),
        ("tis", "tis", {0: {}, 32: dict(drop=0.06)}, {})])
    v = _verdict("m2po_stale", folder)
    assert v["verdict"] == "reproduced" and v["lag"] == 32
    assert "warning" not in v["extra"]  # 40 steps train 8 steps at lag 32
    folder = _tables(tmp_path / "m2po_both", [
        ("m2po", "m2po", {0: {}, 32: dict(drop=0.06)}, {}),
        ("tis", "tis", {0: {}, 32: dict(drop=0.06)}, {})])
    assert _verdict("m2po_stale", folder)["verdict"] == "partly"
    # The :long grid (its own `steps` axis) is judged on its own and leaves the other alone:
    # before, its 160-step runs pooled with (and replaced) the 60-step runs of the same
    # loss, lag and seed.
    long = {"axes": {"steps": "160"}}
    folder = _tables(tmp_path / "m2po_long", [
        ("m2po", "m2po", {0: {}, 32: dict(drop=0.005)}, {}),
        ("tis", "tis", {0: {}, 32: dict(drop=0.06)}, {}),
        ("m2po", "m2po", {0: long, 64: dict(drop=0.06, **long)}, {}),
        ("tis", "tis", {0: long, 64: dict(drop=0.06, **long)}, {})])
    v = _verdict("m2po_stale", folder)
    assert v["verdict"] == "reproduced" and v["lag"] == 32
    v = _verdict("m2po_stale_long", folder)
    assert v["verdict"] == "partly" and v["lag"] == 64, repro.verdict_text(v)

    dec = {0: {}, 2: {}, 4: {}, 8: {}, 16: dict(drop=0.05)}
    ppo = {0: {}, 2: dict(drop=0.04), 4: dict(drop=0.05), 8: dict(drop=0.06),
           16: dict(drop=0.07)}
    folder = _tables(tmp_path / "dppo", [
        ("decoupled_ppo", "decoupled_ppo", dec, {"minibatches": 4}),
        ("ppo", "ppo", ppo, {"minibatches": 4}),
        ("ppo1", "ppo", {0: dict(drop=0.1)}, {})])  # 1 minibatch: not an arm of this one
    v = _verdict("decoupled_ppo", folder)
    assert v["verdict"] == "reproduced", repro.verdict_text(v)
    assert "decoupled 8, ppo 0" in repro.verdict_text(v)
    runs, _ = results.load_runs([folder])
    grid = staleness.lag_grid(runs)
    assert repro.tolerance(grid["decoupled_ppo"]) == 8 and repro.tolerance(grid["ppo"]) == 0
    assert _verdict("tinker_kl", folder)["verdict"] == "insufficient data"


def _m2po_tables(tmp_path):
    """Both m2po forms and tis at two learning rates, lags 0 and 32."""
    low = {"lr": 5e-5}
    return _tables(tmp_path / "both", [
        ("m2po", "m2po", {0: {}, 32: dict(drop=0.005)}, {}),
        ("m2po_released", "m2po", {0: {}, 32: dict(drop=0.10)}, {"form": "released"}),
        ("tis", "tis", {0: {}, 32: dict(drop=0.06)}, {}),
        ("m2po_lowlr", "m2po", {0: {}, 32: {}}, low),
        ("tis_lowlr", "tis", {0: {}, 32: {}}, low)])


def test_m2po_forms_and_learning_rates_are_judged_apart(tmp_path):
    """Both m2po forms (loss.name 'm2po', told apart by loss.form) and a second learning rate
    in one set of runs: each form is an arm, each learning rate a regime with its own verdict.
    Before, the released form and the other rate's runs took the same (arm, lag, seed) slots
    and silently replaced the main grid's runs."""
    folder = _m2po_tables(tmp_path)
    runs, _ = results.load_runs([folder])
    vs = repro.verdicts("m2po_stale", runs)
    assert [v["regime"] for v in vs] == ["lr=5e-05", "lr=0.0001"]
    low_v, main_v = vs
    # main: the paper form holds at lag 32, the released form drops 10 points: partly
    assert main_v["verdict"] == "partly", repro.verdict_text(main_v)
    assert {r["arm"] for r in main_v["rows"]} == {"m2po", "m2po_released", "tis"}
    assert all(r["seeds"] == 3 for r in main_v["rows"])
    claims = main_v["claims"]
    assert claims["m2po at lag 32: no significant drop vs lag 0, no collapsed run"]
    assert not claims["m2po_released at lag 32: no significant drop vs lag 0, no collapsed run"]
    assert "m2po_released - m2po at lag 32" in main_v["extra"]
    # low rate: tis does not drop there, so only the m2po claim holds
    assert low_v["verdict"] == "partly" and set(r["arm"] for r in low_v["rows"]) == {"m2po", "tis"}
    text = repro.verdict_text(main_v)
    assert text.startswith("# M2PO") and "(m2po_stale, lr=0.0001)" in text.splitlines()[0]
    with pytest.raises(ValueError, match="2 learning rates"):
        repro.verdict("m2po_stale", runs)


@pytest.mark.slow  # runs scripts/repro_verdict.py
def test_the_verdict_script_prints_one_verdict_per_regime(tmp_path):
    folder = _m2po_tables(tmp_path)
    done = subprocess.run([sys.executable, "scripts/repro_verdict.py", "--name=m2po_stale",
                           f"--results={folder}"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("verdict: partly") == 2 and "lr=5e-05" in done.stdout


def test_two_runs_in_one_slot_are_an_error_not_a_replacement(tmp_path):
    root = str(tmp_path / "grid")
    for name, cap in (("tis_a", 2.0), ("tis_b", 3.0)):  # both capped tis: one m2po_stale arm
        synthetic.write_run(os.path.join(root, "runs", name), loss="tis", injected=True, k=0,
                            seed=0, steps=8, cap=cap,
                            labels={"loss": name, "lag": "0", "seed": "0"})
    runs, _ = results.load_runs([root])
    with pytest.raises(ValueError, match="both arm 'tis', lag 0, seed 0"):
        repro.arm_grids("m2po_stale", runs)
    # the same run met twice (a rerun, or its directory and its committed table) is one run
    a = next(r for r in runs if "loss=tis_a" in r.name)
    grids = repro.arm_grids("m2po_stale", [a, dataclasses.replace(a, path="elsewhere")])
    assert grids[1e-4]["tis"][0][0].path == "elsewhere"


def test_accuracy_table_and_ess_analysis(tmp_path):
    folder = _tables(tmp_path, [
        ("tis", "tis", {0: {}, 2: dict(ess=0.8), 8: dict(drop=0.05, ess=0.4),
                        32: dict(drop=0.08, ess=0.2)}, {}),
        ("ppo", "ppo", {0: {}, 2: dict(ess=0.9), 8: dict(ess=0.45), 32: dict(ess=0.7)}, {})])
    runs, _ = results.load_runs([folder])
    grid = staleness.lag_grid(runs)
    rows = {(r["loss"], r["lag"]): r for r in staleness.accuracy_table(grid)}
    assert rows[("tis", 8)]["vs_lag0"] == "worse" and rows[("ppo", 8)]["vs_lag0"] == "n.s."
    assert rows[("tis", 0)]["n"] == 3 and rows[("tis", 0)]["half"] > 0.03  # the seed spread
    md = staleness.accuracy_markdown(grid)
    line = next(x for x in md.splitlines() if x.startswith("| tis |"))
    assert line.count("**") == 4 and "↓" in line  # lags 8 and 32 bold
    assert "| ppo |" in md and "**" not in next(x for x in md.splitlines()
                                                 if x.startswith("| ppo |"))
    a = staleness.ess_analysis(grid)
    assert a["losses"]["tis"]["ess_below_lag"] == 8 and a["losses"]["tis"]["drop_lag"] == 8
    assert a["losses"]["ppo"]["ess_below_lag"] == 8 and a["losses"]["ppo"]["drop_lag"] is None
    c = a["classifier"]
    assert (c["tp"], c["fp"], c["fn"], c["tn"]) == (2, 1, 0, 3) and c["accuracy"] == 5 / 6
    assert a["pearson"] > 0.5
    md = staleness.ess_markdown(a)
    assert "| tis |" in md and "right in 83%" in md


@pytest.mark.slow
def test_scripts_on_committed_tables(tmp_path):
    folder = _tables(tmp_path, [("tis", "tis", {0: {}, 8: dict(drop=0.05, ess=0.4)}, {}),
                                ("m2po", "m2po", {0: {}, 32: {}}, {}),
                                ("tis32", "tis", {32: dict(drop=0.06)}, {})])
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = tmp_path / "table.md"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "staleness_report.py"),
                           f"--results={folder}", f"--out={out}",
                           f"--figures={tmp_path / 'figs'}", "--posthoc=tis@8-tis@0,absent@8"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| tis |" in out.read_text() and "ESS" in out.read_text()
    assert "Post-hoc contrasts" in out.read_text() and "| absent@8 | 0 |" in out.read_text()
    assert "| tis@8-tis@0 | 3 |" in out.read_text()
    for name in ("lag_ablation", "diagnostics_by_lag", "ess_vs_drop"):
        assert (tmp_path / "figs" / f"{name}.png").exists(), done.stderr
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "repro_verdict.py"),
                           "--name=all", f"--results={folder}", f"--figures={tmp_path / 'rf'}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]  # tinker and decoupled cells missing
    assert "verdict: reproduced" in done.stdout  # m2po_stale
    assert done.stdout.count("insufficient data") == 3  # + m2po_stale_long
    assert (tmp_path / "rf" / "repro_m2po_stale.png").exists()


def test_the_report_counts_collapsed_runs_per_cell(tmp_path):
    """A cell whose runs fall below half the warm start's accuracy counts them; the others
    count none (the committed protocol report lists these so no collapse goes unmentioned)."""
    folder = _tables(tmp_path, [("tis", "tis", {0: {}, 8: dict(drop=0.35)}, {}),
                                ("ppo", "ppo", {0: {}, 8: dict(drop=0.05)}, {})])
    runs, _ = results.load_runs([folder])
    (grid,) = staleness.by_learning_rate(runs).values()
    text = staleness.collapse_markdown(staleness.main_arms(grid))
    assert "| tis | 0/3 | 3/3 |" in text and "| ppo | 0/3 | 0/3 |" in text
    assert "(3 of 12)" in text


def test_main_arms_keeps_a_grid_run_wholly_at_one_setting():
    """The grid proper: plain arms without the repro arms of other settings beside them; a
    grid whose every arm sits at one setting (the protocol's mb4) whole; arms of different
    settings with none plain, none."""
    cells = {0: {}}
    mixed = {"ppo": cells, "tis (lr=5e-05)": cells, "ppo (minibatches=4)": cells}
    assert sorted(staleness.main_arms(mixed)) == ["ppo", "tis (lr=5e-05)"]
    mb4 = {"ppo (minibatches=4)": cells, "decoupled_ppo (minibatches=4)": cells}
    assert staleness.main_arms(mb4) == mb4
    assert staleness.main_arms({"ppo (minibatches=4)": cells, "tis (cap=4)": cells}) == {}


@pytest.mark.slow  # runs scripts/staleness_report.py
def test_the_protocol_families_of_a_grid_at_four_minibatches(tmp_path):
    """The mb4 grid's runs carry a `minibatches=4` label on every arm. Its one registered
    analysis (2026-12-06) first came out with every family empty: the report kept only arms
    without such a label. Through the script, as it is run: F0 pairs the three PPO-family
    arms at lag 0, F1 and F2 hold every key arm at the confirmatory lag."""
    arms = [(a, a, {0: {}, 8: dict(drop=d)}, {"minibatches": 4, "axes": {"minibatches": "4"}})
            for a, d in (("ppo", 0.0), ("decoupled_ppo", 0.02), ("staleness_clip", 0.1))]
    folder = _tables(tmp_path, arms)
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "staleness_report.py"),
                           f"--results={folder}", f"--out={out}", "--json",
                           "--confirm_arms=decoupled_ppo,ppo,staleness_clip",
                           "--confirm_lags=8"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fams = json.loads(done.stdout.strip().splitlines()[-1])["protocol 0.0001"]
    assert len(fams["null control"]) == 3
    assert {(r["a"], r["lag_a"], r["lag_b"]) for r in fams["staleness cost"]} == {
        (f"{a} (minibatches=4)", 8, 0) for a in ("ppo", "decoupled_ppo", "staleness_clip")}
    assert {r["b"] for r in fams["vs PPO-clip"]} == {"ppo (minibatches=4)"}
    assert len(fams["vs PPO-clip"]) == 2
    text = out.read_text()
    assert "Key arms present: decoupled_ppo (minibatches=4), ppo (minibatches=4)" in text
    assert "Null control PASSES" in text and "of 3 raw p" in text


def test_sync_label_and_the_borrowed_lag_zero():
    """An arm's synchronous run is the same arm without the axes that say how its lag arises
    (the injection's law, the async bound); only arms without a lag-0 cell borrow one."""
    assert staleness.sync_label("ppo (injection=uniform, minibatches=4)") == "ppo (minibatches=4)"
    assert staleness.sync_label("ppo (max_lag=16, minibatches=4)") == "ppo (minibatches=4)"
    assert staleness.sync_label("tis (injection=uniform)") == "tis"
    assert staleness.sync_label("ppo (minibatches=4)") == "ppo (minibatches=4)"
    own, ref = {0: {1: "own"}, 8: {}}, {0: {1: "ref"}}
    grid = staleness.with_sync_reference(
        {"ppo (injection=uniform, minibatches=4)": {8: {}}, "tis (minibatches=4)": own,
         "vcpo (injection=uniform)": {8: {}}},
        {"ppo (minibatches=4)": ref, "tis (minibatches=4)": ref, "vcpo (minibatches=4)": ref})
    assert grid["ppo (injection=uniform, minibatches=4)"][0] == {1: "ref"}
    assert grid["tis (minibatches=4)"][0] == {1: "own"}  # its own lag 0 stays
    assert 0 not in grid["vcpo (injection=uniform)"]  # another setting: nothing borrowed


@pytest.mark.slow  # runs scripts/staleness_report.py
def test_a_variable_lag_grid_takes_its_lag_zero_from_the_sync_reference(tmp_path):
    """The protocol's varlag grid runs no lag 0: the report printed its null control as
    PASSING on zero tests and family 1 empty. Now the null control says it was not tested,
    and with --sync_reference (the mb4 tables) family 1 compares each arm with its
    synchronous run, seed by seed."""
    mb4 = {"minibatches": 4, "axes": {"minibatches": "4"}}
    var = {"minibatches": 4, "axes": {"minibatches": "4", "injection": "uniform"}}
    folder = _tables(tmp_path / "v", [(a, a, {8: dict(drop=d)}, var)
                                      for a, d in (("ppo", 0.0), ("staleness_clip", 0.1))])
    sync = _tables(tmp_path / "s", [(a, a, {0: {}, 8: dict(drop=0.3)}, mb4)
                                    for a in ("ppo", "staleness_clip")])
    out = tmp_path / "report.md"
    args = [sys.executable, os.path.join(ROOT, "scripts", "staleness_report.py"),
            f"--results={folder}", f"--out={out}", "--json", "--confirm_arms=ppo,staleness_clip",
            "--confirm_lags=8"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(args + [f"--sync_reference={sync}"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fams = json.loads(done.stdout.strip().splitlines()[-1])["protocol 0.0001"]
    assert fams["null control"] == []
    cost = {r["a"].split(" (")[0]: r for r in fams["staleness cost"]}
    assert sorted(cost) == ["ppo", "staleness_clip"]
    assert cost["ppo"]["lag_b"] == 0 and cost["ppo"]["diff"] == pytest.approx(0, abs=0.01)
    assert cost["staleness_clip"]["significant"]  # -10 points, not mb4's lag-8 drop of 30
    assert cost["staleness_clip"]["diff"] == pytest.approx(-0.10, abs=0.01)
    text = out.read_text()
    assert "Null control NOT TESTED" in text and "PASSES" not in text
    assert "the synchronous runs of `--sync_reference`" in text
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["protocol 0.0001"][
        "staleness cost"] == []
