"""Staleness-correction ablation: final accuracy vs injected lag for every off-policy loss.

    python experiments/ablate.py --config=configs/ablate/staleness.py --workdir=runs/staleness
    python experiments/ablate.py --config=configs/ablate/staleness.py:quick --workdir=runs/quick
    python scripts/reproduce_figures.py --results=runs/staleness --out=figures/

Every run trains from the same warm start with `lag_injection` (kind 'fixed'): the learner
ships the sampler the weights of version L-k, so every trained token has lag exactly k
(min(k, step) in the first k steps) and a run is deterministic and lock-step. That isolates
the loss's handling of staleness from the pipeline's timing, and makes runs cheap to run two
at a time, one core each. The losses are every loss of the registry, in its order, each
with its default hyperparameters (DESIGN.md): a loss added there joins the grid.

Full grid: 9 losses x 7 lags x 3 seeds = 189 runs, one replicate (seed) at a time. `:quick`: 3 losses x 2 lags x 1 seed.
"""
from configs import default
from pipelinerl_jax.ablation.grid import ablation_config, sweep, variants
from pipelinerl_jax.losses import LOSSES
LAGS = (0, 1, 2, 4, 8, 16, 32)


def get_config(arg: str = ""):
    e = default.get_config()
    e.lag_injection.enabled = True
    e.lag_injection.kind = "fixed"
    # 60 steps: lag-0 runs are still improving at the end (docs/experiments.md).
    e.learner.total_steps = 60
    # Every 20 steps: step 20 of a full-grid run is the :quick grid's last step, so the two
    # grids' cells can be compared (constant learning rate, same warm start, same eval set).
    e.learner.eval_every = 20
    # One fixed held-out set in every cell (and every grid): 256 prompts (standard error of
    # an accuracy near 0.4 is ~3 points; at 64 prompts it was ~6).
    e.learner.eval_size = 256
    e.learner.checkpoint_every = 20
    e.learner.keep_checkpoints = 1
    e.learner.optimizer.learning_rate = 2e-4
    e.warm_start.steps = 300

    c = ablation_config(e)
    c.axes.loss = variants(*[(name, {"loss": {"name": name}}) for name in LOSSES])
    # max_k follows k: the learner keeps (and checkpoints) only the k versions it needs.
    c.axes.lag = sweep("lag_injection.k", LAGS, also=("lag_injection.max_k",))
    c.axes.seed = sweep("seed", (0, 1, 2))
    c.runner.parallel = 2  # lock-step runs: two at once, each on its own core
    c.analysis.target_accuracy = 0.35
    if arg == "quick":
        c.experiment.learner.total_steps = 20
        c.axes.loss.only = "reinforce,ppo,tis"
        c.axes.lag.levels = (0, 8)
        c.axes.seed.levels = (0,)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick')")
    return c
