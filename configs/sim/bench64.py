"""The benchmark setting (scripts/bench_sim.py): 64 x H100, Qwen2.5-7B, 512 prompts x 16
samples per step, async with 19 sampler and 45 trainer devices (the best split the sweep
finds for it), queue of 2 batches, max_lag 4, 1,000 learner steps."""
from pipelinerl_jax.sim.sim_config import default_config


def get_config(arg: str = "async"):
    c = default_config()
    c.mode = arg
    c.steps = 1000
    c.devices = 64
    c.split.samplers = 19
    c.split.trainers = 45
    c.hardware.preset = "h100"
    c.model.preset = "qwen2.5-7b"
    c.train.batch_size = 512
    c.train.group_size = 16
    c.queue.capacity_batches = 2
    c.max_lag = 4
    c.sweep.steps = 100
    c.sweep.max_staleness = 4
    return c
