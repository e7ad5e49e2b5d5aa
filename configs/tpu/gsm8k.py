"""The run a TPU recipe shares: async GRPO-style RL on GSM8K with a Qwen checkpoint, sampled
by the embedded JaxEngine (paged KV, the Pallas kernel per shard of its tensor mesh).

Not a config on its own: `full_v5p8_v5e8.py` and `lora_v5e8.py` place it on slices. `size`
names a shape directory in configs/shapes/ (config.json only): `compile_check` compiles it
as it is; a real run passes `--config.model.path` and `--config.tokenizer.path` of a local
checkpoint of that model, and `--config.task.path` / `task.eval_path` of GSM8K.
"""
import os

from pipelinerl_jax.run_config import base_config

SHAPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shapes")
SIZES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-8b")


def gsm8k_run(size: str):
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r} (valid: {list(SIZES)})")
    c = base_config()
    c.mode = "async"
    c.max_lag = 4
    c.model.init = "hf"
    c.model.path = os.path.join(SHAPES, size)
    c.model.dtype = "bfloat16"  # compute; the master weights are model.param_dtype
    c.model.max_seq_len = 1024  # prompt + completion: the learner packs rows of it
    c.tokenizer.kind = "hf"
    c.tokenizer.path = c.model.path  # a real run: the checkpoint's directory
    c.task.name = "gsm8k"
    c.task.path = "/data/gsm8k/train.jsonl"
    c.task.eval_path = "/data/gsm8k/test.jsonl"
    c.task.max_completion_tokens = 768
    c.sampling.max_new_tokens = 768
    c.sampler.kind = "jax"
    c.engine.dtype = "bfloat16"
    c.engine.kv_layout = "paged"
    c.engine.attention_kernel = "pallas"
    c.engine.max_slots = 128
    c.engine.max_prefill_batch = 8
    c.engine.kv_budget_tokens = 128 * 1024  # the pool: every slot at the full context
    c.engine.steps_per_sync = 16
    c.rollout.group_size = 8
    c.rollout.advantage.estimator = "grpo"
    c.loss.name = "tis"
    c.learner.batch_groups = 32  # 256 sequences a step
    c.learner.optimizer.learning_rate = 1e-6
    c.learner.eval_every = 0
    c.transport.capacity_rollouts = 32768
    c.resources.platform = "tpu"
    return c
