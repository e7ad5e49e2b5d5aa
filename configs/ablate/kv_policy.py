"""kv_policy keep (PipelineRL: in-flight sequences keep the KV cache computed with older
weights) vs recompute (AReaL: in-flight prefixes are re-prefilled with the new weights) at
matched max_lag, in real async runs (lag injection is lock-step and would never update
weights mid-sequence, so it cannot tell the two apart).

    python experiments/ablate.py --config=configs/ablate/kv_policy.py --workdir=runs/kv --figures=figures/
"""
from pipelinerl_jax.ablation.grid import sweep

from configs.ablate import sync_vs_async


def get_config(arg: str = ""):
    c = sync_vs_async.get_config()
    del c.axes["schedule"]
    c.experiment.mode = "async"
    c.axes.max_lag = sweep("max_lag", (2, 4))
    c.axes.kv_policy = sweep("engine.kv_policy", ("keep", "recompute"))
    c.axes.seed = sweep("seed", (0, 1))
    if arg == "quick":
        c.axes.max_lag.levels = (4,)
        c.axes.seed.levels = (0,)
        c.experiment.learner.total_steps = 40
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick')")
    return c
