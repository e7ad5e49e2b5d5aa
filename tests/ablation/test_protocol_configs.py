"""The pre-registered grids (configs/ablate/staleness_protocol.py) expand to what the protocol
states, every run's config validates, and the quick grid's lag contrasts print."""
import itertools
import json
import os
import sys

import ml_collections
import pytest

from pipelinerl_jax import run_config
from pipelinerl_jax.ablation import grid, protocol, results, staleness
from tests.ablation import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from configs.ablate import staleness as staleness_config  # noqa: E402
from configs.ablate import staleness_protocol  # noqa: E402


@pytest.mark.parametrize("arg, runs, seeds", [
    ("", 768, 32), ("mb4", 360, 30), ("varlag", 180, 30), ("async", 60, 10), ("sweep", 210, 10),
    ("drift", 750, 10), ("countdown", 360, 30), ("sort", 360, 30), ("large", 360, 30)])
def test_each_protocol_grid_expands_and_validates(arg, runs, seeds):
    c = staleness_protocol.get_config(arg)
    assert len(c.axes.seed.levels) == seeds
    c.axes.seed.levels = (0,)  # one replicate: expanding every seed is slow and says no more
    rs = grid.expand(c)
    assert len(rs) * seeds == runs
    run_config.validate(ml_collections.ConfigDict(rs[0].config.to_dict()))
    assert c.runner.mode == ("pipeline" if arg == "async" else "inprocess")


def test_the_confirmatory_grid_is_the_protocols():
    c = staleness_protocol.get_config("")
    assert c.axes.seed.levels == tuple(range(32))
    c.axes.seed.levels = (0,)
    rs = grid.expand(c)
    assert {r.labels["loss"] for r in rs} == {a for a, _ in staleness_protocol.KEY_ARMS} \
        == set(protocol.KEY_ARMS)
    assert sorted({int(r.labels["lag"]) for r in rs}) == [0, *protocol.CONFIRM_LAGS]
    m2po = next(r for r in rs if r.labels["loss"] == "m2po_authors").config.loss
    assert m2po.form == "released" and m2po.get("floor_low") is None  # the authors' runs
    # the committed grid's m2po_released arm keeps the floor its runs had
    arms = dict(staleness_config.LOSS_ARMS)
    assert arms["m2po_released"]["loss"]["floor_low"] == 0.3
    assert "floor_low" not in arms["m2po_authors"]["loss"]
    with pytest.raises(ValueError, match="valid"):
        staleness_protocol.get_config("bogus")


def test_lag_contrasts_pair_each_arm_with_its_lag_0(tmp_path):
    for loss in ("reinforce", "ppo"):
        for k in (0, 8):
            for s in range(3):
                synthetic.write_run(str(tmp_path / f"{loss}{k}{s}"), injected=True, k=k, seed=s,
                                    loss=loss, labels={"loss": loss, "lag": str(k),
                                                       "seed": str(s)})
    runs, _ = results.load_runs([str(tmp_path)])
    (grid_,) = staleness.by_learning_rate(runs).values()
    rows = staleness.lag_contrasts(grid_)
    assert [(r["arm"], r["lag"], r["n"]) for r in rows] == [("reinforce", 8, 3), ("ppo", 8, 3)]
    text = staleness.lag_contrasts_text(rows)
    assert "reinforce: lag 8 - lag 0 = " in text and "95% paired t, 3 seeds" in text


def test_the_two_released_m2po_arms_stay_apart_in_the_verdict(tmp_path):
    """Both are loss.name=m2po, form=released; only the floor (and the label) differs. Read
    as one arm, two runs would claim one (lag, seed) slot and the verdict would refuse them."""
    from pipelinerl_jax.ablation import repro
    for label in ("m2po_released", "m2po_authors", "tis"):
        for k in (0, 32):
            for s in range(3):
                synthetic.write_run(str(tmp_path / f"{label}{k}{s}"), injected=True, k=k, seed=s,
                                    loss="tis" if label == "tis" else "m2po",
                                    form=None if label == "tis" else "released",
                                    labels={"loss": label, "lag": str(k), "seed": str(s)})
    runs, _ = results.load_runs([str(tmp_path)])
    (v,) = repro.verdicts("m2po_stale", runs)
    assert {r["arm"] for r in v["rows"]} == {"m2po_released", "m2po_authors", "tis"}
    assert "m2po_authors - tis at lag 32" in v["extra"]


def test_registered_grids_share_runs_only_where_the_docs_say():
    """Two grids that expand to the same run config train the same run (the frozen code is
    deterministic): `drift`'s lr-2e-4 cells at lags 0, 8, 32 are `''`'s, and all 150 shared
    runs ended identical (docs/staleness_study.md, "Protocol results: `drift`"), a rerun the
    docs must not call a replication. Any other overlap a new grid adds fails here."""
    expanded, seeds = {}, {}
    for arg in staleness_protocol.ARGS:  # every registered grid, so a new one is checked too
        c = staleness_protocol.get_config(arg)
        seeds[arg] = set(c.axes.seed.levels)
        c.axes.seed.levels = (0,)
        expanded[arg] = {json.dumps(r.config.to_dict(), sort_keys=True, default=str): r.labels
                         for r in grid.expand(c)}
    shared = {}
    for a, b in itertools.combinations(expanded, 2):
        common = set(expanded[a]) & set(expanded[b])
        if common:
            shared[(a, b)] = sorted((expanded[b][k]["loss"], int(expanded[b][k]["lag"]),
                                     expanded[b][k].get("lr")) for k in common)
    assert list(shared) == [("", "drift")]
    arms = {"reinforce", "ppo", "tis", "decoupled_ppo", "m2po_authors"}
    assert shared[("", "drift")] == sorted((a, k, "0.0002") for a in arms for k in (0, 8, 32))
    assert len(shared[("", "drift")]) * len(seeds[""] & seeds["drift"]) == 150
