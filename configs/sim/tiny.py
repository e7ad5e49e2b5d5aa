"""A tiny simulation that runs in well under a second (tests, smoke runs): the measured CPU
preset and the tiny decoder, 4 devices, 8 prompts x 4 samples per step."""
from pipelinerl_jax.sim.sim_config import default_config


def get_config(arg: str = "async"):
    c = default_config()
    c.mode = arg
    c.steps = 20
    c.devices = 4
    c.split.samplers = 2
    c.split.trainers = 2
    c.hardware.preset = "cpu"
    c.model.preset = "tiny"
    c.lengths.median = 24.0
    c.lengths.tail = 120.0
    c.rollout.max_new_tokens = 256
    c.rollout.prompt_len = 16
    c.rollout.concurrency = 16
    c.train.batch_size = 8
    c.train.group_size = 4
    c.weight_sync_s = 0.05
    c.max_lag = 4
    c.queue.capacity_batches = 2
    c.sweep.steps = 20
    c.output.series_dt_s = 0.05
    return c
