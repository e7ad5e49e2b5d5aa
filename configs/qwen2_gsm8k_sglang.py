"""Async pipeline RL on GSM8K with a Qwen2.5-0.5B-style checkpoint, sampled by SGLang servers.

Needs GPU hosts with SGLang (`pip install "pipelinerl_jax[sglang]"`); see docs/sglang.md.
Sampler host (5 GPUs, one server each, weights at the learner's version 0 layout; four
servers sample rollouts, the fifth serves the held-out evaluation):

    python scripts/launch_sglang.py --model-path /data/models/Qwen2.5-0.5B-Instruct \
        --num-servers 5 --gpus-per-server 1 --base-port 30000 --weight-version 0

Learner host (8 devices, sharded learner), pointing at those servers:

    python experiments/train.py --config=configs/qwen2_gsm8k_sglang.py:gpu8 --workdir=/shared/run \
        --config.model.path=/data/models/Qwen2.5-0.5B-Instruct \
        --config.tokenizer.path=/data/models/Qwen2.5-0.5B-Instruct \
        --config.task.path=/data/gsm8k/train.jsonl --config.task.eval_path=/data/gsm8k/test.jsonl \
        --config.sglang.urls="('http://10.0.0.2:30000','http://10.0.0.2:30001',\
'http://10.0.0.2:30002','http://10.0.0.2:30003')" \
        --config.sglang.eval_urls="('http://10.0.0.2:30004',)"

The learner writes every version to `sampler.weights_dir` (default WORKDIR/weights), which the
SGLang servers read by path: it must be the same path on both hosts (a shared file system);
so must the workdir, whose `eval_versions/` the evaluation server reads the same way.
The argument after ':' picks the learner's mesh (data, fsdp, tensor) from MESH_PRESETS.
"""
from pipelinerl_jax.run_config import base_config

MODEL = "/data/models/Qwen2.5-0.5B-Instruct"  # a local HF directory, never a hub id
DATA = "/data/gsm8k"
MESH_PRESETS = {
    "gpu8": (1, 4, 2),  # one 8-GPU host: FSDP over 4, tensor parallel 2 (2 KV heads)
    "gpu4": (1, 4, 1),  # one 4-GPU host: FSDP over 4
    "v5e8": (1, 4, 2),  # a TPU v5e-8 slice
    "cpu": (1, 1, 1),  # one device (smoke tests)
}


def get_config(arg: str = "gpu8"):
    if (arg or "gpu8") not in MESH_PRESETS:
        raise ValueError(f"unknown mesh preset {arg!r} (valid: {sorted(MESH_PRESETS)})")
    c = base_config()
    c.mode = "async"
    c.max_lag = 4

    # ---- model and data: a pretrained checkpoint from local disk, GSM8K-format JSONL
    c.model.init = "hf"
    c.model.path = MODEL
    c.model.dtype = "bfloat16"  # compute; parameters and optimizer state stay float32
    c.tokenizer.kind = "hf"
    c.tokenizer.path = MODEL
    c.task.name = "gsm8k"
    c.task.path = f"{DATA}/train.jsonl"
    c.task.eval_path = f"{DATA}/test.jsonl"
    c.task.max_completion_tokens = 512

    # ---- sampling on SGLang servers (scripts/launch_sglang.py starts them)
    c.sampler.kind = "sglang"
    c.sampler.keep_weight_versions = 3  # a version is read by the servers right after it lands
    c.sglang.urls = tuple(f"http://127.0.0.1:{30000 + i}" for i in range(4))
    c.sglang.eval_urls = ("http://127.0.0.1:30004",)  # the evaluator role's server
    c.sglang.concurrency_per_server = 128
    c.sglang.pause_mode = "retract"  # KV recomputed with the new weights on every refit
    c.sglang.on_abort = "resubmit"
    c.rollout.num_workers = 2  # tokenisation and rewards; each drives 2 of the servers
    c.rollout.group_size = 8
    c.rollout.advantage.estimator = "grpo"
    c.sampling.max_new_tokens = 512
    c.sampling.temperature = 1.0
    c.model.max_seq_len = 1024  # the pipeline's context: prompt + completion (learner packing)

    # ---- learner: sharded over the mesh preset
    c.mesh.shape = MESH_PRESETS[arg or "gpu8"]
    c.loss.name = "tis"
    c.learner.batch_groups = 32  # 256 sequences per step
    c.learner.minibatches = 4
    c.learner.micro_batches = 1
    c.learner.total_steps = 500
    c.learner.optimizer.learning_rate = 1e-6
    c.learner.optimizer.warmup_steps = 10
    c.learner.eval_every = 50
    c.learner.eval_size = 200
    # Rollouts stay queued until the checkpoint covering them is durable: 256 rows x
    # (2 x 25 + max_lag + 2) fits the default 16384-rollout queue.
    c.learner.checkpoint_every = 25
    c.warm_start.steps = 0  # the checkpoint is already instruction-tuned
    return c
