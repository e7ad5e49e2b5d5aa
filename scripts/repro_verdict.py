"""Verdict of a published-phenomenon experiment (configs/repro/<name>.py): our numbers beside
the published ones, each claim checked, and reproduced / partly / not with the rule used.

  PYTHONPATH=. python scripts/repro_verdict.py --name=tinker_kl --results=runs/staleness
  PYTHONPATH=. python scripts/repro_verdict.py --name=all \
      --results=results/staleness,results/repro
  PYTHONPATH=. python scripts/repro_verdict.py --name=m2po_stale --results=DIR --figures=figs/

`--results` takes committed-table folders (scripts/export_results.py), grid or run
directories, several at once: runs are picked by their config (pipelinerl_jax/ablation/
repro.py), so a phenomenon may combine its own grid with the full staleness grid's cells.
One verdict per learning rate among a phenomenon's runs (the regime it holds in; the study's
drift subgrid runs a quarter of the main grid's rate). Exits 0 whatever the verdict; 2 when
a phenomenon has no regime with every cell it needs.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import figures, repro, results  # noqa: E402

_NAME = flags.DEFINE_string("name", "all", f"One of {sorted(repro.PHENOMENA)} or 'all'.")
_RESULTS = flags.DEFINE_list("results", [], "Committed-table folders, grid or run directories.")
_FIGURES = flags.DEFINE_string("figures", "", "If set, draw repro_<name> figures here.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line per phenomenon instead of text.")


def main(argv):
    del argv
    names = sorted(repro.PHENOMENA) if _NAME.value == "all" else [_NAME.value]
    unknown = [n for n in names if n not in repro.PHENOMENA]
    if unknown:
        raise app.UsageError(f"--name: unknown {unknown}; valid: {sorted(repro.PHENOMENA)} "
                             f"or 'all'")
    if not _RESULTS.value:
        raise app.UsageError("give --results=DIR[,DIR...]")
    runs, problems = results.load_runs(_RESULTS.value)
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    missing = False
    for name in names:
        vs = repro.verdicts(name, runs)  # one per learning rate among its runs
        missing |= all("missing" in v for v in vs)
        for v in vs:
            print(json.dumps(v, default=str) if _JSON.value else repro.verdict_text(v) + "\n")
    if _FIGURES.value:
        figures.make_all(_RESULTS.value, _FIGURES.value, only=[f"repro_{n}" for n in names],
                         log=lambda m: print(m, file=sys.stderr))
    sys.exit(2 if missing else 0)


if __name__ == "__main__":
    app.run(main)
