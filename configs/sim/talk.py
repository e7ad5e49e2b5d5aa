"""The setting of the "Efficient RL" talk (Applied Compute): one synchronous step samples
40 prompts x 32 samples; ~99% of samples finish in ~40 s and the last 1% need ~80 s more.

Hardware and model are public presets (8 x H100, Qwen3-8B shapes); the length distribution
is a lognormal (median 400, p99 3,800 tokens) cut at 16,384 tokens, plus 0.4% of samples
that ramble to that cut; chosen so that the simulated sync step reproduces the talk's
completion times (scripts/reproduce_sim_figures.py prints them). Variants: `talk.py:sync`, `talk.py:async`, `talk.py:sweep`.
"""
from pipelinerl_jax.sim.sim_config import default_config


def get_config(arg: str = "async"):
    c = default_config()
    c.mode = arg
    c.steps = 60
    c.devices = 8
    c.split.samplers = 4
    c.split.trainers = 4
    c.hardware.preset = "h100"
    c.model.preset = "qwen3-8b"
    c.lengths.median = 400.0
    c.lengths.tail = 3800.0
    c.lengths.truncated_fraction = 0.004
    c.rollout.max_new_tokens = 16384
    c.rollout.prompt_len = 512
    c.rollout.concurrency = 256
    c.train.batch_size = 40
    c.train.group_size = 32
    c.weight_sync_s = 3.0  # 16 GB of bf16 weights broadcast at ~5 GB/s
    c.max_lag = 4
    c.queue.capacity_batches = 2
    c.sweep.max_staleness = 4
    c.sweep.steps = 60
    return c
