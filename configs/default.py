"""The main job: warm start, then async pipeline RL on long-tailed string reversal (CPU).

    python experiments/train.py --config=configs/default.py --workdir=runs/default
    python experiments/train.py --config=configs/default.py:quick --workdir=/tmp/q   # smoke

A ~0.4M-parameter 2-layer Llama-style model is trained from scratch: a short supervised warm
start on demonstrations, then GRPO-style RL with one sampler process and one learner process,
each pinned to one of the two cores.
"""
from pipelinerl_jax.run_config import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.mode = "async"
    c.max_lag = 2
    c.task.name = "reverse"
    c.task.median_length = 12
    c.task.p99_length = 69
    c.task.max_length = 96
    c.sampling.max_new_tokens = 97  # longest answer + EOS
    c.model.max_seq_len = 256
    c.engine.max_seq_len = 256
    c.engine.max_slots = 64
    c.rollout.group_size = 8
    c.rollout.advantage.estimator = "grpo"
    c.loss.name = "tis"
    c.learner.batch_groups = 8
    c.learner.total_steps = 200
    # RL moves a tiny model fast: at 5e-4 the KL to the behaviour policy reached 0.4
    # nats/token within 5 steps and accuracy collapsed; 3e-4 was unstable; 1e-4 climbs.
    c.learner.optimizer.learning_rate = 1e-4
    c.learner.eval_every = 25
    c.learner.eval_size = 256
    c.learner.checkpoint_every = 50
    # Warm start: 250 supervised steps whose learning rate ends annealed (warmup 50, cosine
    # from 3e-3 down to 3e-4 at step 250). Held-out exact match climbs a cliff with SFT
    # (seed 0: ~4% after this schedule, 56% with the same schedule stretched to 300 steps):
    # this stops at its foot, where a small shift moves the end point by a few points, and
    # leaves RL the climb. The old schedule (cosine over 1000 steps, stopped at step 300 near
    # the peak rate) stopped mid-cliff: last-bit differences moved it between 18% and 36%.
    c.warm_start.steps = 250
    ws = c.warm_start.optimizer
    ws.learning_rate, ws.warmup_steps, ws.decay = 3e-3, 50, "cosine"
    ws.total_steps, ws.final_lr_ratio = c.warm_start.steps, 0.1
    c.resources.learner_cores = "0"
    c.resources.sampler_cores = "1"
    if arg == "quick":
        quick(c)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick')")
    return c


def quick(c):
    """A minute-scale smoke run of the same pipeline (`:quick`), in place."""
    c.warm_start.steps = 30
    c.warm_start.optimizer.total_steps, c.warm_start.optimizer.warmup_steps = 30, 5
    c.learner.total_steps = 6
    c.learner.eval_every = 3
    c.learner.eval_size = 16
    c.learner.checkpoint_every = 3
    c.learner.batch_groups = 2
    c.rollout.group_size = 4
    c.engine.max_slots = 16
