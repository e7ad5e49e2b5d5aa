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
    c.model.max_seq_len = 256  # the context: prompt + completion, for every role
    c.engine.max_slots = 64
    # Paged KV cache (docs/engine.md): one prompt prefill per group of 8, pages instead of
    # max_slots x max_seq_len reserved; the same pool bytes as dense. Measured against dense
    # on this job (3 seeds x 200 steps, same warm start): held-out accuracy within noise,
    # pace ~0.9x on CPU (the reference paged attention gathers pages). kv_layout='dense'
    # stays available as the reference layout.
    c.engine.kv_layout = "paged"
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
    # Warm start: supervised steps at lr 3e-3 (cosine over 1000 steps) until the held-out
    # exact match, evaluated every 10 steps, first reaches 30% (at most 600 steps). Held-out
    # accuracy climbs a cliff whose step moves with the seed (seed 0 crosses 30% at step ~280,
    # seed 1 at ~150, seed 2 past 300) and with last-bit differences, so the former fixed
    # 300 steps landed anywhere from ~10% to ~37%; the target lands every seed at 30-36%
    # (docs/experiments.md, "The warm start").
    c.warm_start.steps = 600
    c.warm_start.target_accuracy = 0.3
    c.warm_start.eval_every = 10
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
    c.warm_start.target_accuracy = 0.0  # (30 steps: the format only)
    c.learner.total_steps = 6
    c.learner.eval_every = 3
    c.learner.eval_size = 16
    c.learner.checkpoint_every = 3
    c.learner.batch_groups = 2
    c.rollout.group_size = 4
    c.engine.max_slots = 16
