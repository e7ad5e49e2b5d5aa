"""Every figure of docs/experiments.md from logged runs (never from numbers typed in).

  PYTHONPATH=. python scripts/reproduce_figures.py --out=docs/figures/experiments  # results/*/
  PYTHONPATH=. python scripts/reproduce_figures.py --results=runs/staleness,runs/sva --out=figures/
  PYTHONPATH=. python scripts/reproduce_figures.py --results=runs/sva --only=sync_vs_async
  PYTHONPATH=. python scripts/reproduce_figures.py --sim --out=docs/figures   # + the simulator's

`--results` takes grid directories (experiments/ablate.py), run directories
(experiments/train.py), folders of either, or folders of committed tables
(scripts/export_results.py: runs.csv, cells.csv, steps.csv, histograms.csv); without it
(and without --sim), every folder under results/ that holds steps.csv. Each figure picks the
runs it needs by their config (pipelinerl_jax/ablation/figures.py); one whose runs are
absent is skipped with the reason, and a missing or malformed run directory is reported by
name and left out. Writes <name>.png and <name>.svg per figure, and prints one JSON line
with what each figure shows.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import figures  # noqa: E402

_RESULTS = flags.DEFINE_list("results", [], "Grid, run or committed-table directories "
                             "(comma-separated; default: results/*/ with a steps.csv).")
_OUT = flags.DEFINE_string("out", "figures", "Folder for the PNG and SVG files.")
_ONLY = flags.DEFINE_list("only", [], f"Draw only these: {', '.join(figures.FIGURES)}.")
_TARGET = flags.DEFINE_float("target_accuracy", None, "Held-out accuracy the sync-vs-async "
                             "speedup is measured to (default: the best every schedule reaches).")
_SIM = flags.DEFINE_bool("sim", False, "Also run scripts/reproduce_sim_figures.py into OUT/sim.")


def committed_tables():
    """Every folder under ROOT/results holding committed tables (steps.csv)."""
    base = os.path.join(ROOT, "results")
    if not os.path.isdir(base):
        return []
    return [os.path.join(base, d) for d in sorted(os.listdir(base))
            if os.path.isfile(os.path.join(base, d, "steps.csv"))]


def main(argv):
    del argv
    unknown = [n for n in _ONLY.value if n not in figures.FIGURES]
    if unknown:
        raise app.UsageError(f"--only: unknown figure(s) {unknown}; valid: {list(figures.FIGURES)}")
    roots = _RESULTS.value or ([] if _SIM.value else committed_tables())
    if not roots and not _SIM.value:
        raise app.UsageError("no results/*/steps.csv here: give --results=DIR[,DIR...] and/or "
                             "--sim")
    out = {"figures": {}, "problems": []}
    if roots:
        out = figures.make_all(roots, _OUT.value, only=_ONLY.value,
                               target_accuracy=_TARGET.value, log=lambda m: print(m, flush=True))
    if _SIM.value:
        sim_out = os.path.join(_OUT.value, "sim")
        done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts",
                                                            "reproduce_sim_figures.py"),
                               f"--out={sim_out}"], env=dict(os.environ, PYTHONPATH=ROOT),
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"reproduce_sim_figures.py failed:\n{done.stderr[-3000:]}")
        out["figures"]["sim"] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out, default=float))


if __name__ == "__main__":
    app.run(main)
