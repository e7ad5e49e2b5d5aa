"""The staleness grid as markdown tables for docs/experiments.md, from committed CSVs or runs.

  PYTHONPATH=. python scripts/staleness_report.py --results=results/staleness --out=table.md
  PYTHONPATH=. python scripts/staleness_report.py --results=runs/staleness --figures=figures/
  PYTHONPATH=. python scripts/staleness_report.py --results=results/staleness_protocol/async \
      --sync_reference=results/staleness_protocol/mb4 --confirm_arms=decoupled_ppo,ppo,staleness_clip

First, per learning rate, the pre-registered protocol (docs/staleness_study.md) on its
primary endpoint, final held-out accuracy: the null control (family 0: arms that are one
update at lag 0 must not differ), the staleness cost (family 1: each key arm at each
confirmatory lag against its lag 0) and the contrast with PPO-clip (family 2), each
comparison with its 95% interval, the minimum detectable effect at 80% power and its raw and
Holm-adjusted p-value (pipelinerl_jax/ablation/protocol.py); and where the runs ran
(provenance: machines, library versions, code; cells mixing them are listed). Everything
after that is secondary and labelled so.

Then (secondary), per learning rate of the runs found: final held-out accuracy per loss x
injected lag as "mean ± half-width" of the 95% Student-t interval over seeds, bold with an
arrow where the seed-paired interval of the difference to the same loss at lag 0 excludes 0;
the resolution of the loss-vs-loss comparisons at lags >= 4 (half-widths, minimum detectable
effects, the false positives their count implies) and the significant pairs; arms whose runs
are identical number for number, and what each decoupled loss reduces to under the grid's
settings; the ESS analysis (pipelinerl_jax/ablation/staleness.py). With two learning rates,
also the protocol's drift models (ablation/drift.py: the drop on log lag, log rate, both,
and log(rate x lag), scored by leave-one-seed-out R²) and the drift table: each cell's
accuracy drop beside its measured KL and ESS (outcomes of the run). `--figures` also draws
lag_ablation, diagnostics_by_lag, ess_vs_drop and drop_vs_drift (and, with two rates,
drop_vs_rate_x_updates). `--json` prints the numbers as one JSON line as well.

Real asynchronous runs (the protocol's `async` grid: no injection, the pipeline's timing sets
the lags under the bound max_lag) get their own section (ablation/async_grid.py): the cost of
asynchrony against each arm's synchronous run (`--sync_reference`), each arm against PPO-clip
at the same bound, and the lags the runs trained on, reported as the outcome they are.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import (  # noqa: E402
    async_grid, drift, figures, protocol, results, staleness, sweep_grid)

_RESULTS = flags.DEFINE_list("results", [], "Committed-table folders, grid or run directories.")
_OUT = flags.DEFINE_string("out", "", "Markdown file to write (default: print only).")
_FIGURES = flags.DEFINE_string("figures", "", "If set, draw the staleness figures here.")
_ESS = flags.DEFINE_float("ess_threshold", staleness.ESS_THRESHOLD, "ESS threshold.")
_REEVAL = flags.DEFINE_list(
    "reeval", [], "CSV(s) written by scripts/staleness_reeval.py: also give every comparison's "
    "resolution on the final checkpoints re-scored on the larger held-out set.")
_SYNC_REF = flags.DEFINE_list(
    "sync_reference", [], "Tables or runs holding each arm's synchronous in-process run at lag "
    "0 (the protocol's `mb4` grid), read only as that reference, not reported as a grid: the "
    "lag 0 of family 1 for a grid without one (`varlag`) and of family A1 (`async`).")
_DEFAULT_REF = flags.DEFINE_list(
    "default_reference", [], "For the protocol's `sweep` grid: tables or runs of the `''` grid, "
    "whose arms at the sweep's lag are each loss's default setting where the sweep holds none "
    "(decoupled_ppo), and the control for those it holds (identical runs).")
_JSON = flags.DEFINE_bool("json", False, "Also print the analysis as one JSON line.")
_ARMS = flags.DEFINE_list("confirm_arms", list(protocol.KEY_ARMS),
                          "The protocol's key arms (families 1 and 2; those present).")
_LAGS = flags.DEFINE_list("confirm_lags", [str(k) for k in protocol.CONFIRM_LAGS],
                          "The protocol's confirmatory lags (families 1 and 2).")
_POSTHOC = flags.DEFINE_list(
    "posthoc", [], "Secondary contrasts chosen after reading the families, each arm@lag terms "
    "joined by + or - (e.g. vcpo@0-ppo@0, vcpo@8-vcpo@0-ppo@8+ppo@0): printed with their "
    "intervals and raw p, labelled post hoc, never in a family.")


def protocol_section(grid, lr, with_ref=None) -> tuple:
    """The protocol's families on the primary endpoint for one learning rate: (markdown
    lines, JSON). `with_ref`: the grid with the lag-0 cells of `--sync_reference` given to
    arms that ran none (families 1 and 2 read it; the null control reads only `grid`)."""
    fn = staleness.final_accuracy
    own, grid = grid, with_ref or grid
    borrowed = sorted(a for a in grid if 0 in grid[a] and 0 not in own.get(a, {}))
    lags = [int(k) for k in _LAGS.value]
    arms, fams = protocol.families(grid, fn, _ARMS.value, lags, own=own)
    lines = [f"## Protocol, learning rate {lr:g}: primary endpoint (final held-out accuracy)", ""]
    if not arms:  # e.g. the `sweep` grid: its registered analysis is its own section
        return lines + [f"This grid holds none of the key arms ({', '.join(_ARMS.value)}): "
                        "the protocol's families 0-2 do not apply to it.", ""], fams
    lines += [f"Key arms present: {', '.join(arms)}; the families' lags: "
              f"{', '.join(map(str, lags))} (confirmatory only in the `''` and `mb4` grids; "
              "every other grid is secondary, docs/staleness_study.md). Holm within each "
              "family, 5% two-sided.", ""]
    null = fams["null control"]
    verdict = ("NOT TESTED: no pair of arms of this grid ran at lag 0" if not null else
               f"{'PASSES' if not any(r['significant'] for r in null) else 'FAILS'}: "
               f"{sum(r['p'] < 0.05 for r in null)} of {len(null)} raw p < 0.05, "
               f"{sum(r['significant'] for r in null)} after Holm")
    lines += ["### Family 0: null control (lag 0; one update in exact arithmetic: "
              f"{', '.join(protocol.null_arms(own)) or 'none'})", "",
              protocol.family_markdown(null), "", f"Null control {verdict}.", ""]
    if any("injection=uniform" in a for a in grid):
        lines += ["A variable-lag grid: 'lag L' is the largest lag of the uniform draw on "
                  "0..L made each step (mean L/2), not a fixed lag.", ""]
    if borrowed:
        lines += ["Lag 0 of " + ", ".join(borrowed) + ": the synchronous runs of "
                  "`--sync_reference` (the same arm without its lag-source axis, same seeds "
                  "and learning rate), not runs of this grid.", ""]
    lines += ["### Family 1: staleness cost (each key arm at lag L vs its lag 0)", "",
              protocol.family_markdown(fams["staleness cost"]), "",
              "### Family 2: each key arm vs PPO-clip at the same lag", "",
              protocol.family_markdown(fams["vs PPO-clip"]), ""]
    return lines, {k: v for k, v in fams.items()}


def posthoc_section(grid, fn=staleness.final_accuracy) -> tuple:
    """The `--posthoc` contrasts on the primary endpoint: (markdown lines, JSON rows)."""
    base = {a.split(" (")[0]: a for a in grid}
    rows = []
    for text in _POSTHOC.value:
        terms = [(c, base.get(a, a), k) for c, a, k in protocol.parse_contrast(text)]
        rows.append({"contrast": text, **(protocol.contrast(grid, fn, terms) or {"n": 0})})
    lines = ["### Post-hoc contrasts (chosen after reading the families: secondary, no "
             "correction)", "", "| contrast | seeds | mean (pts) | 95% CI | paired SD | "
             "MDE 80% | p |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["n"]:
            lines.append(f"| {r['contrast']} | 0 | | | | | |")
            continue
        lo, hi = (r["diff"] - r["half"]) * 100, (r["diff"] + r["half"]) * 100
        lines.append(f"| {r['contrast']} | {r['n']} | {r['diff'] * 100:+.1f} | "
                     f"[{lo:+.1f}, {hi:+.1f}] | {r['sd'] * 100:.1f} | {r['mde'] * 100:.1f} | "
                     f"{r['p']:.3g} |")
    return lines + [""], rows


def provenance_section(runs) -> tuple:
    """Where the runs ran, and the cells whose runs disagree on it."""
    prov = results.mixed_provenance(runs)
    lines = ["## Provenance of the runs", "",
             "| field | values (runs) |", "|---|---|"]
    for col, vals in prov["values"].items():
        lines.append(f"| {col} | " + "; ".join(f"{v} ({n})" for v, n in sorted(vals.items()))
                     + " |")
    mixed = prov["mixed_cells"]
    cells = sorted({m["cell"] for m in mixed})
    lines += ["", (f"{len(cells)} cells mix runs of different provenance (or recorded with "
                   f"unrecorded): " + ", ".join(cells[:20]) + (" ..." if len(cells) > 20 else "")
                   if cells else "No cell mixes runs of different provenance."),
              "'unrecorded': runs from before provenance was recorded (their machine, "
              "libraries and code version are not known; docs/staleness_study.md).", ""]
    return lines, prov


def main(argv):
    del argv
    if not _RESULTS.value:
        raise app.UsageError("give --results=DIR[,DIR...]")
    runs, problems = results.load_runs(_RESULTS.value)
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    refs, ref_problems = results.load_runs(_SYNC_REF.value) if _SYNC_REF.value else ([], [])
    for p in ref_problems:
        print(f"skipped: {p}", file=sys.stderr)
    groups = staleness.by_learning_rate(runs)
    ref_groups = staleness.by_learning_rate(refs)
    asyncs = async_grid.async_grids(runs + refs)
    if not groups and not asyncs:
        sys.exit("no lag-injected or asynchronous runs with evaluations under "
                 + ",".join(_RESULTS.value))
    parts, out_json = [], {}
    for lr, grid in groups.items():
        main = staleness.main_arms(grid)
        lines, fams = protocol_section(main, lr, staleness.with_sync_reference(
            main, staleness.main_arms(ref_groups.get(lr, {}))))
        parts += lines
        out_json[f"protocol {lr:g}"] = fams
    for lr, grid in asyncs.items():
        fams = async_grid.families(grid, _ARMS.value)
        parts += [async_grid.section_markdown(grid, fams, lr)]
        out_json[f"async {lr:g}"] = fams
        if _FIGURES.value:
            print(f"async_bounds: {async_grid.figure(grid, _FIGURES.value, lr)}",
                  file=sys.stderr)
    dgroups = (staleness.by_learning_rate(results.load_runs(_DEFAULT_REF.value)[0])
               if _DEFAULT_REF.value else {})
    for lr, grid in groups.items():
        for lag in sorted({k for cells in grid.values() for k in cells}):
            sets = sweep_grid.settings(grid, dgroups.get(lr), lag)
            if sets:
                fams = sweep_grid.sensitivity(sets)
                parts += [sweep_grid.section_markdown(sets, fams, lag, lr)]
                out_json[f"sweep {lr:g} lag {lag}"] = {
                    "sensitivity": fams, "control": sweep_grid.control(sets),
                    "best": sweep_grid.best(sets)}
                if _FIGURES.value:
                    print(f"sweep_settings: {sweep_grid.figure(sets, _FIGURES.value, lag, lr)}",
                          file=sys.stderr)
    lines, out_json["provenance"] = provenance_section(runs + refs)
    parts += lines
    if groups:  # the lag-injected grids' secondary tables (an async-only grid has none)
        parts += ["# Secondary analyses (not the protocol's primary endpoint or families)", ""]
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
                  "### Collapsed runs", "", staleness.collapse_markdown(grid), "",
                  "### Resolution: every loss-vs-loss comparison at lag >= 4", "",
                  staleness.resolution_markdown(rows), "",
                  "Significant pairs:", "", staleness.pairwise_markdown(rows), "",
                  *curve, *rescored,
                  *(posthoc_section(main)[0] if _POSTHOC.value else []),
                  "### Arms that are the same update", "",
                  staleness.identical_markdown(same, notes), "",
                  "### Does the ESS of the stalest lag bucket predict the drop?", "",
                  staleness.ess_markdown(ess), ""]
        if _POSTHOC.value:
            extra["posthoc"] = posthoc_section(main)[1]
        out_json[f"{lr:g}"] = {"accuracy": staleness.accuracy_table(grid), "ess": ess,
                               "resolution": staleness.resolution(rows), "identical": same,
                               "reductions": notes, **extra}
    drops = []  # each seed's paired drop: the drift models and the published-terms figure
    if len(groups) > 1:
        drops = drift.seed_drops({lr: staleness.main_arms(g) for lr, g in groups.items()})
        cells = staleness.drift_cells({lr: staleness.main_arms(g) for lr, g in groups.items()})
        per = staleness.kl_vs_inputs(cells)
        models = drift.drift_models(drops)
        parts += ["## Drift models: the drop from inputs set before the run (the protocol's)",
                  "", drift.drift_models_markdown(models), "",
                  "## Measured drift: KL as an outcome of each run (not an input)", "",
                  staleness.drift_markdown(cells, per), ""]
        out_json["drift"] = {"cells": cells, "per_loss": per, "models": models}
    text = "\n".join(parts)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text)
    print(text)
    if _FIGURES.value and drops:
        drift.published_terms_figure(drops, _FIGURES.value)
    if _FIGURES.value:
        figures.make_all(_RESULTS.value, _FIGURES.value,
                         only=("lag_ablation", "diagnostics_by_lag", "ess_vs_drop",
                               "drop_vs_drift"),
                         log=lambda m: print(m, file=sys.stderr))
    if _JSON.value:
        print(json.dumps(out_json, default=str))


if __name__ == "__main__":
    app.run(main)
