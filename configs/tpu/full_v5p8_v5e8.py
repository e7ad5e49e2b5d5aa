"""Full fine-tuning of Qwen2.5-7B (configs/tpu/gsm8k.py) on two slices: the learner on a v5p-8
(4 chips, FSDP over all four), the samplers on a v5e-8 (two rollout workers, each an engine of
4 chips, tensor-parallel over its attention heads and MLP).

    python experiments/compile_check.py --config=configs/tpu/full_v5p8_v5e8.py \\
        --topology=v5p:2x2x1 --sampler_topology=v5e:2x4

The argument after ':' picks another size of configs/shapes/ (e.g. `:qwen3-8b`).
Memory, per learner chip: float32 master weights (4 bytes a parameter) and Adam's moments (8)
and the float32 gradient accumulator (4), over 4 chips: 16 x 7.6e9 / 4 = 30 GB of v5p's 95,
plus the activations of one micro-batch, plus the bf16 snapshot a version is published from
(15.2 GB / 4, alive while the next step runs; `learner.publish_dtype` 'auto' publishes the
engines' bf16). Per sampler chip: bf16 weights 15.2 GB / 4 plus a quarter of the KV pool.
"""
from configs.tpu.gsm8k import gsm8k_run


def get_config(arg: str = "qwen2.5-7b"):
    c = gsm8k_run(arg or "qwen2.5-7b")
    c.model.param_dtype = "float32"
    c.mesh.shape = (1, 4, 1)  # the v5p-8's 4 chips, ZeRO-3 style
    # 4 sequences (1 packed row of 1,024 a chip) per micro-batch: at 8 (32 micro-batches) the
    # step's 86.6 GiB a chip plus the 3.5 GiB bf16 snapshot overflow a v5p chip's 88.5
    c.learner.micro_batches = 64
    c.rollout.num_workers = 2
    c.resources.learner_devices = "0-3"  # on the learner's slice
    c.resources.sampler_devices = "0-7"  # on the samplers' slice: 4 chips a worker
    c.engine.tensor_parallel = 4
    return c
