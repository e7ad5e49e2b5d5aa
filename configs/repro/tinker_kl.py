"""Repro: unclipped importance weighting at staleness ~3 lets the sampler-trainer KL grow by
more than an order of magnitude and degrades, while PPO's clipped ratio stays stable
(tinker-cookbook async RL discussion: KL ~30x at K=3).

    python experiments/ablate.py --config=configs/repro/tinker_kl.py --workdir=runs/staleness
    PYTHONPATH=. python scripts/repro_verdict.py --name=tinker_kl --results=runs/staleness

"Unclipped IS" is `tis` with cap 1e6: the registry has no uncapped per-token IS loss
(`reinforce` is uncorrected, and a cap must be finite), and at this scale no token's
ratio comes near 1e6, so the weight sg(π/μ)·A·∇log π is the plain IS policy gradient (the
gradient of tinker's -(π/μ)·A). Everything else is the staleness grid's
(configs/ablate/staleness.py): running it in that grid's workdir reuses its `ppo` lag-0
runs (same names, same configs) and its warm start; lag 3 and `tis_nocap` are new.
2 losses x lag {0, 3} x the grid's seeds (the `ppo` lag-0 runs already in the full grid).
"""
from configs.ablate import staleness
from pipelinerl_jax.ablation.grid import variants

NO_CAP = 1e6


def get_config(arg: str = ""):
    c = staleness.get_config()
    c.axes.loss = variants(("tis_nocap", {"loss": {"name": "tis", "cap": NO_CAP}}),
                           ("ppo", {"loss": {"name": "ppo"}}))
    c.axes.lag.levels = (0, 3)
    if arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '')")
    return c
