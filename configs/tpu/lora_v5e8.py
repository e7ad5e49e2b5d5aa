"""Qwen2.5-7B with LoRA (configs/tpu/gsm8k.py) on one v5e-8 split between the roles: the
learner on chips 0-3 (tensor-parallel; rank-16 adapters on every projection train, the bf16
base is frozen), one rollout worker on chips 4-7 (an engine tensor-parallel over 4 chips).

    python experiments/compile_check.py --config=configs/tpu/lora_v5e8.py --topology=v5e:2x4

The argument after ':' picks another size of configs/shapes/ (e.g. `:qwen2.5-1.5b`).
Memory, per learner chip: the bf16 base 15.2 GB / 4, adapters and their float32 Adam state
(a few hundred MB), and a quarter of the activations of one packed row of 1,024 tokens (the
model keeps every activation for the backward pass, attention scores included: with FSDP and
4 sequences a micro-batch the compiler needed 33 GB of temporaries a chip at 2,048 tokens).
"""
from configs.tpu.gsm8k import gsm8k_run


def get_config(arg: str = "qwen2.5-7b"):
    c = gsm8k_run(arg or "qwen2.5-7b")
    c.model.param_dtype = "bfloat16"  # the frozen base as served
    c.lora.enabled = True
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.learner.optimizer.learning_rate = 1e-5
    c.mesh.shape = (1, 1, 4)  # heads, MLP and vocab split: activations a quarter a chip
    c.learner.micro_batches = 256  # one sequence (one packed row) per micro-batch
    c.rollout.num_workers = 1
    c.resources.learner_devices = "0-3"
    c.resources.sampler_devices = "4-7"
    c.engine.tensor_parallel = 4
    return c
