"""Ablation grids: `python experiments/ablate.py --config=configs/ablate/<name>.py --workdir=DIR`.

Expands the grid the config describes (loss x hyperparameters x lag x kv_policy x seeds x
mode ...), trains one shared warm start into DIR/warm_start (unless
`--config.experiment.warm_start.checkpoint=PATH`), runs every unfinished run (re-running the
same command resumes), and writes DIR/results.csv, runs.csv, cells.csv and summary.json.

    python experiments/ablate.py --config=configs/ablate/staleness.py:quick --workdir=runs/quick
    python experiments/ablate.py --config=configs/ablate/staleness.py --workdir=runs/staleness \
        --config.axes.loss.only=tis,ppo --config.axes.lag.levels=(0,8) --config.runner.parallel=2
    python experiments/ablate.py ... --figures=figures/   # also draw every figure it can
    python experiments/ablate.py ... --dry_run             # list the runs and exit
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.config_checks import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ablate/staleness.py",
                                          "Ablation config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Grid directory.", required=True)
_FIGURES = flags.DEFINE_string("figures", "", "If set, draw the figures into this folder.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the runs and their status, then exit.")


def main(argv):
    del argv
    from pipelinerl_jax.ablation import grid, runner
    try:
        runs = grid.expand(_CONFIG.value)
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    if _DRY_RUN.value:
        for r in runs:
            print(f"{runner.run_status(os.path.join(_WORKDIR.value, 'runs', r.dirname)):8s} "
                  f"{r.name}")
        print(f"{len(runs)} runs")
        return
    out = runner.run_grid(_CONFIG.value, _WORKDIR.value, runs=runs)
    _print_lag_contrasts(_WORKDIR.value)
    if _FIGURES.value:
        from pipelinerl_jax.ablation import figures
        out["figures"] = figures.make_all([_WORKDIR.value], _FIGURES.value)["figures"]
    print(json.dumps({k: v for k, v in out.items() if k not in ("ran", "skipped")}, indent=2,
                     default=str))


def _print_lag_contrasts(workdir: str) -> None:
    """For a lag-injected grid: each arm's lag-k minus lag-0 final accuracy, paired by seed."""
    from pipelinerl_jax.ablation import results, staleness
    runs, _ = results.load_runs([os.path.join(workdir, "runs")])
    for lr, grid in staleness.by_learning_rate(runs).items():
        rows = staleness.lag_contrasts(grid)
        if rows:
            print(f"final held-out accuracy, lag k - lag 0 (learning rate {lr:g}):")
            print(staleness.lag_contrasts_text(rows), flush=True)


if __name__ == "__main__":
    app.run(main)
