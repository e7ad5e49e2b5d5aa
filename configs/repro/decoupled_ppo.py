"""Repro: decoupled PPO with a proximal policy (AReaL, arXiv 2505.24298) tolerates larger
staleness than standard PPO (their eta sweep: staleness up to ~4-8 without loss).

    python experiments/ablate.py --config=configs/repro/decoupled_ppo.py --workdir=runs/staleness
    PYTHONPATH=. python scripts/repro_verdict.py --name=decoupled_ppo --results=runs/staleness

With one minibatch per step the proximal policy is the current one and decoupled PPO is
PPO (docs/experiments.md); here every batch is split into 4 minibatches (4 optimizer steps),
so the proximal policy (the params at the start of the step) differs from the current one
after the first. Both losses run with 4 minibatches. The one-level axis `minibatches=4`
keeps the run names apart from the staleness grid's 1-minibatch runs, so the command may
share that grid's workdir (and warm start) without mixing them up.
Learning rate 5e-5 (a quarter of the grid's 2e-4): four updates per step at 2e-4 did not
learn even at lag 0 (21-22% held-out vs 39% with one minibatch, 2026-12-01). Run it in its
own workdir sharing the grid's warm start
(`--config.experiment.warm_start.checkpoint=runs/staleness/warm_start/model`): its run names
match the 2e-4 attempt's, which the runner refuses to mix.
`staleness_clip` runs beside them: with a proximal policy that differs from the current one
its lag cap and its proximal clip both act.
3 losses x lag {0, 2, 4, 8, 16} x the grid's seeds.
"""
from configs.ablate import staleness
from pipelinerl_jax.ablation.grid import sweep, variants


def get_config(arg: str = ""):
    c = staleness.get_config()
    c.experiment.learner.optimizer.learning_rate = 5e-5
    c.axes.loss = variants(("decoupled_ppo", {"loss": {"name": "decoupled_ppo"}}),
                           ("ppo", {"loss": {"name": "ppo"}}),
                           ("staleness_clip", {"loss": {"name": "staleness_clip"}}))
    c.axes.lag.levels = (0, 2, 4, 8, 16)
    c.axes.minibatches = sweep("learner.minibatches", (4,))
    if arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '')")
    return c
