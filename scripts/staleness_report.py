"""The staleness grid as markdown tables for docs/experiments.md, from committed CSVs or runs.

  PYTHONPATH=. python scripts/staleness_report.py --results=results/staleness --out=table.md
  PYTHONPATH=. python scripts/staleness_report.py --results=runs/staleness --figures=figures/

Writes (and prints) two tables: final held-out accuracy per loss x injected lag as "mean ±
half-width" of the 95% Student-t interval over seeds, bold with an arrow where the
seed-paired interval of the difference to the same loss at lag 0 excludes 0; and the ESS
analysis (pipelinerl_jax/ablation/staleness.py): per loss the first lag whose stalest-bucket
ESS is below --ess_threshold and the first lag with a significant accuracy drop, plus how
well the one predicts the other over every cell. `--figures` also draws lag_ablation,
diagnostics_by_lag and ess_vs_drop. `--json` prints the numbers as one JSON line as well.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import figures, results, staleness  # noqa: E402

_RESULTS = flags.DEFINE_list("results", [], "Committed-table folders, grid or run directories.")
_OUT = flags.DEFINE_string("out", "", "Markdown file to write (default: print only).")
_FIGURES = flags.DEFINE_string("figures", "", "If set, draw the staleness figures here.")
_ESS = flags.DEFINE_float("ess_threshold", staleness.ESS_THRESHOLD, "ESS threshold.")
_JSON = flags.DEFINE_bool("json", False, "Also print the analysis as one JSON line.")


def main(argv):
    del argv
    if not _RESULTS.value:
        raise app.UsageError("give --results=DIR[,DIR...]")
    runs, problems = results.load_runs(_RESULTS.value)
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    grid = staleness.lag_grid(runs)
    if not grid:
        sys.exit("no lag-injected runs with evaluations under " + ",".join(_RESULTS.value))
    ess = staleness.ess_analysis(grid, _ESS.value)
    text = "\n".join([
        "### Final held-out accuracy vs injected lag", "",
        staleness.accuracy_markdown(grid), "",
        "### Does the ESS of the stalest lag bucket predict the drop?", "",
        staleness.ess_markdown(ess), ""])
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text)
    print(text)
    if _FIGURES.value:
        figures.make_all(_RESULTS.value, _FIGURES.value,
                         only=("lag_ablation", "diagnostics_by_lag", "ess_vs_drop"),
                         log=lambda m: print(m, file=sys.stderr))
    if _JSON.value:
        print(json.dumps({"accuracy": staleness.accuracy_table(grid), "ess": ess},
                         default=str))


if __name__ == "__main__":
    app.run(main)
