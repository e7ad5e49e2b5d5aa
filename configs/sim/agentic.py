"""An agentic workload on the talk's machine (8 x H100, Qwen3-8B shapes): episodes of 2-8
model turns (uniform), each turn a lognormal answer (median 200, p99 1,500 tokens, cut at
2,048), a tool call between turns taking 0.5-10 s (drawn uniformly from five values), and
200 environment tokens appended per tool answer. 32 prompts x 8 episodes per step.
Variants: `agentic.py:sync`, `agentic.py:async`, `agentic.py:sweep`.
"""
from pipelinerl_jax.sim.sim_config import default_config


def get_config(arg: str = "async"):
    c = default_config()
    c.mode = arg
    c.steps = 30
    c.devices = 8
    c.split.samplers = 4
    c.split.trainers = 4
    c.hardware.preset = "h100"
    c.model.preset = "qwen3-8b"
    c.lengths.median = 200.0
    c.lengths.tail = 1500.0
    c.rollout.max_new_tokens = 2048
    c.rollout.prompt_len = 512
    c.rollout.concurrency = 256
    c.train.batch_size = 32
    c.train.group_size = 8
    c.workload.turns = (2, 3, 4, 5, 6, 7, 8)
    c.workload.tool_latency = (0.5, 1.0, 2.0, 4.0, 10.0)
    c.workload.env_tokens = 200
    c.weight_sync_s = 3.0
    c.max_lag = 4
    c.queue.capacity_batches = None  # a bounded queue re-runs epochs: slow with TurnPool
    c.sweep.max_staleness = 4
    c.sweep.steps = 30
    return c
