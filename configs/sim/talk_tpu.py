"""The talk's long-tailed workload (configs/sim/talk.py: 40 prompts x 32 samples a step,
lognormal lengths with median 400 and p99 3,800 tokens, cut at 16,384) on one TPU v5e-8
slice, Qwen2.5-7B with LoRA, with the decode and train step costs the TPU compiler gives for
configs/tpu/lora_v5e8.py (`costs_from`: its compile check's JSON, results/tpu/):

    python experiments/compile_check.py --config=configs/tpu/lora_v5e8.py --topology=v5e:2x4 \\
        --out=results/tpu/lora_v5e8_qwen2.5-7b.json
    python experiments/simulate.py --config=configs/sim/talk_tpu.py --workdir=/tmp/talk_tpu

An engine is the recipe's 4 chips (tensor-parallel); the learner holds the frozen bf16 base
(2 bytes a parameter) plus adapters and their Adam state, so 2 chips are its minimum. The
sweep (the default) tries every learner size and reports the best split against sync RL on
all 8 chips; `talk_tpu.py:async` / `:sync` simulate the recipe's 4 + 4 split.
"""
import os

from configs.sim import talk

COSTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "results", "tpu", "lora_v5e8_qwen2.5-7b.json")


def get_config(arg: str = "sweep"):
    c = talk.get_config(arg)
    c.hardware.preset = "tpu-v5e"
    c.model.preset = "qwen2.5-7b"
    c.devices = 8
    c.split.samplers, c.split.trainers = 4, 4
    c.rollout.devices_per_engine = 4
    c.train.state_bytes_per_param = 2.2  # the frozen bf16 base + rank-16 adapters and Adam
    c.weight_sync_s = 0.5  # adapters only: ~80 MB
    c.costs_from = COSTS
    return c
