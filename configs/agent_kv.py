"""Agentic RL on CPU: follow keys through a hidden key-value store (multi-turn episodes).

    python experiments/train.py --config=configs/agent_kv.py --workdir=runs/agent_kv
    python experiments/train.py --config=configs/agent_kv.py:quick --workdir=/tmp/q

A problem is ``find qzk=``; the model queries ``get qzk;``, reads ``=bta``, queries
``get bta;``, reads ``=4821`` and answers ``4821`` (pipelinerl_jax/envs/kv_lookup.py). The
answer is a fresh random number per problem, reachable only through the tool. Same tiny char
model and recipe as configs/agent_calculator.py: warm start on whole episodes (tool replies
masked), then async GRPO over groups of episodes.
"""
from pipelinerl_jax.run_config import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.mode = "async"
    c.max_lag = 2
    c.task.name = "kv_lookup"  # an environment: its keys are in c.env
    c.env.num_keys = 6
    c.env.min_hops = 1
    c.env.max_hops = 3
    c.env.key_length = 3
    c.env.max_turns = 0  # the task's default: max_hops + 2
    c.env.max_turn_tokens = 12
    c.env.max_episode_tokens = 96
    # At temperature 1 the warm-started model succeeds in ~7% of sampled episodes (34%
    # greedy) and RL taught it to run on past the stop token; sampling cooler, penalising
    # truncated episodes and dropping all-equal groups (DAPO) keeps the signal useful.
    c.sampling.temperature = 0.7
    c.env.truncated_reward = -0.5
    c.env.dynamic_sampling = True
    c.model.max_seq_len = 96
    c.engine.max_slots = 64
    c.rollout.group_size = 8
    c.rollout.advantage.estimator = "grpo"
    c.loss.name = "tis"
    c.learner.batch_groups = 16
    c.learner.total_steps = 300
    c.learner.optimizer.learning_rate = 2e-4
    c.learner.optimizer.decay = "cosine"
    c.learner.optimizer.total_steps = c.learner.total_steps
    c.learner.eval_every = 25
    c.learner.eval_size = 256
    c.learner.checkpoint_every = 50
    # The supervised curve has a sharp step (0% held-out success at 150 steps, ~72% at 200):
    # 180 steps lands on it.
    c.warm_start.steps = 180
    c.resources.learner_cores = "0"
    c.resources.sampler_cores = "1"
    if arg == "quick":  # a minute-scale smoke run of the same pipeline
        c.warm_start.steps = 20
        c.learner.total_steps = 4
        c.learner.eval_every = 2
        c.learner.eval_size = 8
        c.learner.checkpoint_every = 2
        c.learner.batch_groups = 2
        c.rollout.group_size = 4
        c.engine.max_slots = 16
        c.env.dynamic_sampling = False  # a barely trained model's groups are mostly all-equal
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick')")
    return c
