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
    # The warm start below solves the held-out set greedily (100%); RL samples at
    # temperature 1, where episodes still fail, and trains on the groups that are not
    # all-equal (DAPO's dynamic sampling: 54.5% of groups were dropped and replaced).
    # Truncated episodes are penalised so that RL never learns to run past the stop token.
    c.sampling.temperature = 1.0
    c.env.truncated_reward = -0.5
    c.env.dynamic_sampling = True
    c.model.max_seq_len = 96
    c.engine.max_slots = 64
    c.engine.kv_layout = "paged"  # multi-turn turns reuse earlier turns' pages
    c.rollout.group_size = 8
    c.rollout.advantage.estimator = "grpo"
    c.loss.name = "tis"
    c.learner.batch_groups = 16
    c.learner.total_steps = 60
    c.learner.optimizer.learning_rate = 2e-4
    c.learner.optimizer.decay = "cosine"
    c.learner.optimizer.total_steps = c.learner.total_steps
    c.learner.eval_every = 30
    c.learner.eval_size = 256
    c.learner.checkpoint_every = 30
    # Learning to copy the tool's 4-digit answer is a sharp step of the supervised curve. At
    # the default warm-start learning rate (3e-3) its end point moves with the step count and
    # the last bits (2026-12-02, held-out: 180 steps of the default schedule 0%; cosine over
    # 300 / 400 / 600 steps 6.3% / 0% / 100%); at 1e-3 over 600 steps (cosine) the step is at ~100-140 and the run ends far
    # past it: loss 0.0036, 100% held-out greedy (BENCHMARKS.md, agentic environments).
    c.warm_start.steps = 600
    c.warm_start.optimizer.learning_rate = 1e-3
    c.warm_start.optimizer.total_steps = c.warm_start.steps
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
