"""Compact, committable tables of a grid: runs.csv, cells.csv and steps.csv.

  PYTHONPATH=. python scripts/export_results.py --results=runs/staleness --out=results/staleness
  PYTHONPATH=. python scripts/export_results.py --results=runs/repro_tinker,runs/repro_dppo \
      --out=results/repro
  PYTHONPATH=. python scripts/export_results.py --results=runs/sb --out=results/sampler_bound \
      --raw_run='schedule=sync,seed=0' --raw_run='schedule=async2,seed=0'
  # a grid resumed on a machine without the earlier workdir: the committed tables beside it
  PYTHONPATH=. python scripts/export_results.py --results=results/G,W/G --out=results/G \
      --finished_only

steps.csv keeps, per run and step, the metrics every figure drawn from step metrics needs
(results.STEP_COLUMNS and the per-lag-bucket tokens, ESS, clip fraction and KL k3, blank where
a bucket has no tokens) at 6 significant digits; histograms, per-sample lists and the rest
of metrics.jsonl stay in the run directories, except for the runs named by --raw_run, whose
raw logs are copied to OUT/raw/<name>/ (the simulator calibrates from them).
scripts/reproduce_figures.py, scripts/staleness_report.py and scripts/repro_verdict.py read
the folder like a grid. A run read from committed tables keeps its runs.csv row verbatim
(re-deriving it from the 6-digit steps.csv would move means in their last digit); cells.csv is
computed from runs.csv as written, so an export of an export is the same.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import results  # noqa: E402

_RESULTS = flags.DEFINE_list("results", [], "Grid or run directories.")
_OUT = flags.DEFINE_string("out", None, "Folder for the tables.", required=True)
_RAW = flags.DEFINE_multi_string("raw_run", [], "A run whose raw logs (metrics, samples, "
                                 "engine_stats, config) are copied to OUT/raw/<name>/: what the "
                                 "occupancy_vs_sim figure calibrates the simulator from. Repeat.")

_FINISHED = flags.DEFINE_bool("finished_only", False, "Leave out runs that are not done or "
                              "diverged (a grid stopped mid-way resumes them later).")


def _analysis(roots):
    for root in roots:  # a grid's own thresholds (ablation.json), if any
        try:
            with open(os.path.join(root, "ablation.json")) as f:
                return json.load(f)["analysis"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def main(argv):
    del argv
    if not _RESULTS.value:
        raise app.UsageError("give --results=DIR[,DIR...]")
    analysis = _analysis(_RESULTS.value)
    out = results.export_tables(_RESULTS.value, _OUT.value, analysis,
                                finished_only=_FINISHED.value)
    if analysis is not None:  # the grid's thresholds travel with its tables (reports read them)
        with open(os.path.join(_OUT.value, "ablation.json"), "w") as f:
            json.dump({"analysis": analysis}, f, indent=2)
    try:
        out["tables"]["raw"] = results.export_raw(_RESULTS.value, _RAW.value, _OUT.value)
    except results.RunError as e:
        raise app.UsageError(str(e)) from None
    for p in out["problems"]:
        print(f"skipped: {p}", file=sys.stderr)
    sizes = {k: os.path.getsize(v) for k, v in out["tables"].items() if k != "raw"}
    print(json.dumps({"runs": out["runs"], "bytes": sizes, **out["tables"]}))


if __name__ == "__main__":
    app.run(main)
