"""Exporting committed tables beside a new workdir (a grid resumed on a fresh machine whose
earlier workdir is gone): the committed runs keep their runs.csv rows verbatim, the new runs
get theirs from full-precision logs, and no steps.csv or histograms.csv line is lost."""
import csv
import os

from pipelinerl_jax.ablation import results
from tests.ablation import synthetic


def _grid(root, seeds):
    for s in seeds:
        for loss in ("ppo", "tis"):
            # values with more than the 6 digits steps.csv keeps: a row re-derived from
            # the committed steps.csv moves in its last digit (kl_k3_mean 0.0622671 ->
            # 0.0622672 for seed 0)
            synthetic.write_run(os.path.join(root, f"{loss}{s}"), injected=True, k=4, seed=s,
                                loss=loss, labels={"loss": loss, "seed": str(s)},
                                kl_fn=lambda t, s=s: 0.0234567891 * (t + 1 + s) ** 0.5,
                                ess_fn=lambda t: 0.9 - 0.0031415926 * t ** 0.5)
    return root


def _lines(path):
    with open(path, newline="") as f:
        return f.read().splitlines()


def test_committed_rows_survive_a_merged_export_verbatim(tmp_path):
    first = str(tmp_path / "committed")
    results.export_tables([_grid(str(tmp_path / "w1"), (0, 1))], first)
    later = _grid(str(tmp_path / "w2"), (2,))
    alone, merged = str(tmp_path / "alone"), str(tmp_path / "merged")
    results.export_tables([later], alone)
    out = results.export_tables([first, later], merged)
    assert out["runs"] == 6 and not out["problems"]
    head, *rows = _lines(os.path.join(merged, "runs.csv"))
    committed = _lines(os.path.join(first, "runs.csv"))
    new = _lines(os.path.join(alone, "runs.csv"))
    assert head == committed[0] == new[0]
    assert sorted(rows) == sorted(committed[1:] + new[1:])  # byte for byte, both halves
    for table in (results.STEPS_CSV, results.HISTOGRAMS_CSV):
        merged_lines = set(_lines(os.path.join(merged, table)))
        assert set(_lines(os.path.join(first, table))) <= merged_lines
        assert set(_lines(os.path.join(alone, table))) <= merged_lines
    # the cells are over all six runs, from those same rows
    with open(os.path.join(merged, "cells.csv")) as f:
        cells = list(csv.DictReader(f))
    assert sorted(int(c["runs"]) for c in cells) == [3, 3]


def test_an_export_of_an_export_is_the_same(tmp_path):
    once, twice = str(tmp_path / "once"), str(tmp_path / "twice")
    results.export_tables([_grid(str(tmp_path / "w"), (0, 1, 2))], once)
    results.export_tables([once], twice)
    for table in ("runs.csv", "cells.csv", results.STEPS_CSV, results.HISTOGRAMS_CSV):
        assert _lines(os.path.join(once, table)) == _lines(os.path.join(twice, table)), table
