"""The staleness grid as markdown tables for docs/experiments.md, from committed CSVs or runs.

  PYTHONPATH=. python scripts/staleness_report.py --results=results/staleness --out=table.md
  PYTHONPATH=. python scripts/staleness_report.py --results=runs/staleness --figures=figures/

Writes (and prints), per learning rate of the runs found: final held-out accuracy per loss x
injected lag as "mean ± half-width" of the 95% Student-t interval over seeds, bold with an
arrow where the seed-paired interval of the difference to the same loss at lag 0 excludes 0;
the resolution of the loss-vs-loss comparisons at lags >= 4 (half-widths, minimum detectable
effects, the false positives their count implies) and the significant pairs; arms whose runs
are identical number for number, and what each decoupled loss reduces to under the grid's
settings; the ESS analysis (pipelinerl_jax/ablation/staleness.py). With two learning rates,
also the drift table: each cell's accuracy drop beside its measured KL and ESS, and whether
drift or lag predicts the drop. `--figures` also draws lag_ablation, diagnostics_by_lag,
ess_vs_drop and drop_vs_drift. `--json` prints the numbers as one JSON line as well.
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
_REEVAL = flags.DEFINE_list(
    "reeval", [], "CSV(s) written by scripts/staleness_reeval.py: also give every comparison's "
    "resolution on the final checkpoints re-scored on the larger held-out set.")
_JSON = flags.DEFINE_bool("json", False, "Also print the analysis as one JSON line.")


def main(argv):
    del argv
    if not _RESULTS.value:
        raise app.UsageError("give --results=DIR[,DIR...]")
    runs, problems = results.load_runs(_RESULTS.value)
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    groups = staleness.by_learning_rate(runs)
    if not groups:
        sys.exit("no lag-injected runs with evaluations under " + ",".join(_RESULTS.value))
    parts, out_json = [], {}
    for lr, grid in groups.items():
        main = staleness.main_arms(grid)
        ess = staleness.ess_analysis(main, _ESS.value)
        rows = staleness.pairwise(main)
        same = staleness.identical_arms(grid)
        notes = staleness.reductions(main)
        # one pass over lags >= 1: the goal's lags (>= 4) and lags 1-2, which sit outside the
        # 5-point goal and are printed apart so that the goal's tables and counts stay the goal's
        every_curve = staleness.pairwise(main, staleness.curve_accuracy, min_lag=1)
        curve_rows = [r for r in every_curve if r["lag"] >= 4]
        near_rows = [r for r in every_curve if r["lag"] in (1, 2)]
        curve_metric = ("mean held-out accuracy of the evaluations at steps >= "
                        f"{staleness.CURVE_FROM_STEP}")
        curve = ["### Resolution of the curve level (mean accuracy over steps >= "
                 f"{staleness.CURVE_FROM_STEP})", "",
                 staleness.resolution_markdown(curve_rows, metric=curve_metric), ""]
        if near_rows:
            curve += ["### Resolution of the curve level at lags 1-2 (outside the 5-point goal)",
                      "", staleness.resolution_markdown(near_rows, metric=curve_metric), ""]
        rescored, extra = [], {"resolution_curve": staleness.resolution(curve_rows),
                               "resolution_curve_lags_1_2": staleness.resolution(near_rows)}
        if _REEVAL.value:
            fn, sizes = staleness.rescored_accuracy(_REEVAL.value)
            what = (f"final checkpoint re-scored on {'/'.join(map(str, sizes))} held-out "
                    "problems (scripts/staleness_reeval.py)")
            rows_rescored = staleness.pairwise(main, fn)
            rescored = ["### Resolution on the re-scored final checkpoints", "",
                        staleness.resolution_markdown(rows_rescored, metric=what), "",
                        "Significant pairs (re-scored):", "",
                        staleness.pairwise_markdown(rows_rescored), ""]
            extra.update(resolution_rescored=staleness.resolution(rows_rescored),
                         rescored_eval_sizes=sizes)
        parts += [f"## Learning rate {lr:g}", "",
                  "### Final held-out accuracy vs injected lag", "",
                  staleness.accuracy_markdown(grid), "",
                  "### Resolution: every loss-vs-loss comparison at lag >= 4", "",
                  staleness.resolution_markdown(rows), "",
                  "Significant pairs:", "", staleness.pairwise_markdown(rows), "",
                  *curve, *rescored,
                  "### Arms that are the same update", "",
                  staleness.identical_markdown(same, notes), "",
                  "### Does the ESS of the stalest lag bucket predict the drop?", "",
                  staleness.ess_markdown(ess), ""]
        out_json[f"{lr:g}"] = {"accuracy": staleness.accuracy_table(grid), "ess": ess,
                               "resolution": staleness.resolution(rows), "identical": same,
                               "reductions": notes, **extra}
    if len(groups) > 1:
        cells = staleness.drift_cells({f"lr {lr:g}": staleness.main_arms(g)
                                       for lr, g in groups.items()})
        per = staleness.drift_vs_lag(cells)
        parts += ["## Staleness as drift: accuracy drop vs measured KL, both learning rates",
                  "", staleness.drift_markdown(cells, per), ""]
        out_json["drift"] = {"cells": cells, "per_loss": per}
    text = "\n".join(parts)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text)
    print(text)
    if _FIGURES.value:
        figures.make_all(_RESULTS.value, _FIGURES.value,
                         only=("lag_ablation", "diagnostics_by_lag", "ess_vs_drop",
                               "drop_vs_drift"),
                         log=lambda m: print(m, file=sys.stderr))
    if _JSON.value:
        print(json.dumps(out_json, default=str))


if __name__ == "__main__":
    app.run(main)
