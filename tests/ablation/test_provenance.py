"""Provenance: every run's status and runs.csv say where and how it ran; runs that never
recorded it read 'unrecorded'; cells mixing machines or libraries are listed."""
import json
import os
import subprocess

import pytest

from pipelinerl_jax import provenance
from pipelinerl_jax.ablation import results
from tests.ablation import synthetic


@pytest.mark.slow  # starts git to check the sha
def test_this_process_provenance_is_read_not_guessed():
    from importlib import metadata
    p = provenance.provenance()
    assert set(p) == set(provenance.FIELDS)
    for lib in provenance.LIBRARIES:
        assert p[lib] == metadata.version(lib)
    head = subprocess.run(["git", "-C", provenance.ROOT, "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert p["git_sha"].split("-")[0] == head
    assert p["cpu_model"] and len(p["machine_id"]) == 12


def _run(root, seed, machine=None, jax_version="0.10.2"):
    path = synthetic.write_run(os.path.join(root, f"s{seed}"), injected=True, k=4, seed=seed,
                               labels={"lag": "4", "seed": str(seed)})
    if machine is not None:
        prov = dict(provenance.provenance(), machine_id=machine, jax=jax_version)
        with open(os.path.join(path, "status.json"), "w") as f:
            json.dump({"status": "done", "mode": "inprocess", "provenance": prov}, f)
    return path


def test_runs_csv_carries_provenance_and_the_report_flags_mixed_cells(tmp_path):
    root = str(tmp_path / "runs")
    _run(root, 0, machine="aaaaaaaaaaaa")
    _run(root, 1, machine="bbbbbbbbbbbb")
    _run(root, 2)  # from before provenance was recorded
    runs, _ = results.load_runs([root])
    rows = {r["seed"]: r for r in (results.summarize_run(r, None) for r in runs)}
    assert rows[0]["machine_id"] == "aaaaaaaaaaaa" and rows[0]["runner_mode"] == "inprocess"
    assert rows[0]["jax"] == "0.10.2"
    assert all(rows[2][c] == results.PROVENANCE_UNRECORDED for c in results.PROVENANCE_COLUMNS)
    # committed tables keep it, and a run without it stays 'unrecorded', never blank
    tables = str(tmp_path / "tables")
    results.export_tables([root], tables)
    again, problems = results.load_tables(tables)
    assert not problems
    back = {results.summarize_run(r, None)["seed"]: r for r in again}
    assert back[1].provenance["machine_id"] == "bbbbbbbbbbbb"
    assert back[2].provenance == {}
    mixed = results.mixed_provenance(again)
    cols = {m["column"] for m in mixed["mixed_cells"]}
    assert "machine_id" in cols and "runner_mode" in cols
    machine = next(m for m in mixed["mixed_cells"] if m["column"] == "machine_id")
    assert machine["values"] == ["aaaaaaaaaaaa", "bbbbbbbbbbbb", "unrecorded"]
    assert mixed["values"]["jax"] == {"0.10.2": 2, "unrecorded": 1}
