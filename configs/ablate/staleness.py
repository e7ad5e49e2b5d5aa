"""Staleness-correction ablation: final accuracy vs injected lag for every off-policy loss.

    python experiments/ablate.py --config=configs/ablate/staleness.py --workdir=runs/staleness
    python experiments/ablate.py --config=configs/ablate/staleness.py:quick --workdir=runs/quick
    python scripts/reproduce_figures.py --results=runs/staleness --out=figures/

    python experiments/ablate.py --config=configs/ablate/staleness.py:lowlr --workdir=runs/staleness_lowlr

Every run trains from the same warm start with `lag_injection` (kind 'fixed'): the learner
ships the sampler the weights of version L-k, so every trained token has lag exactly k
(min(k, step) in the first k steps) and a run is deterministic and lock-step. That isolates
the loss's handling of staleness from the pipeline's timing, and makes runs cheap to run two
at a time, one core each. The losses are every loss of the registry, in its order, each
with its default hyperparameters (DESIGN.md), plus m2po's released-code form
(`m2po_released`): a loss added to the registry joins the grid unless listed in
OUTSIDE_GRID.

Full grid: 12 loss arms x 7 lags x 10 seeds = 840 runs, one replicate (seed) at a time.
Ten seeds because the seed-paired difference between two losses has an SD of ~5.5 points at
lag >= 4 (the 3-seed grid of 2026-12-01): its 95% half-width is t(9)·5.5/√10 ≈ 3.9 points at
10 seeds (13.7 at 3). `:lowlr`: the drift subgrid, learning rate 5e-5 (a quarter: one version
moves the policy ~an order of magnitude less in KL), 7 loss arms x 7 lags x 10 seeds = 490
runs, its run names carrying `lr=5e-05`. `:quick`: 3 losses x 2 lags x 1 seed.
"""
from configs import default
from pipelinerl_jax.ablation.grid import ablation_config, sweep, variants
from pipelinerl_jax.losses import LOSSES
LAGS = (0, 1, 2, 4, 8, 16, 32)
SEEDS = tuple(range(10))
LOW_LR = 5e-5
# Corrections in the registry that are not arms: of issue 40's four, the two the literature
# ties to staleness join (vcpo, which its paper evaluates at lags up to 128, and seq_is, the
# sequence-level TIS that paper compares against); opsm and a3po stay out.
OUTSIDE_GRID = ("opsm", "a3po")
# Every other registry loss with its defaults, plus the other form of m2po.
LOSS_ARMS = tuple((name, {"loss": {"name": name}}) for name in LOSSES
                  if name not in OUTSIDE_GRID) + (
    ("m2po_released", {"loss": {"name": "m2po", "form": "released"}}),)
LOW_LR_ARMS = ("reinforce", "ppo", "tis", "decoupled_ppo", "staleness_clip", "m2po",
               "m2po_released")


def get_config(arg: str = ""):
    e = default.get_config()
    # The committed tables of this grid were measured on the dense KV layout (the main job
    # moved to paged afterwards, issue 25): pinned so a re-run reproduces them.
    e.engine.kv_layout = "dense"
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
    e.warm_start.target_accuracy = 0.0  # its committed tables: the fixed 300 steps

    c = ablation_config(e)
    c.axes.loss = variants(*LOSS_ARMS)
    # max_k follows k: the learner keeps (and checkpoints) only the k versions it needs.
    c.axes.lag = sweep("lag_injection.k", LAGS, also=("lag_injection.max_k",))
    c.axes.seed = sweep("seed", SEEDS)
    c.runner.parallel = 2  # lock-step runs: two at once, each on its own core
    c.analysis.target_accuracy = 0.35
    if arg == "quick":
        c.experiment.learner.total_steps = 20
        c.axes.loss.only = "reinforce,ppo,tis"
        c.axes.lag.levels = (0, 8)
        c.axes.seed.levels = (0,)
    elif arg == "lowlr":
        c.experiment.learner.optimizer.learning_rate = LOW_LR
        c.axes.lr = sweep("learner.optimizer.learning_rate", (LOW_LR,))
        c.axes.loss.only = ",".join(LOW_LR_ARMS)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick', 'lowlr')")
    return c
