"""configs/qwen2_gsm8k_sglang.py with LoRA: the learner trains rank-16 adapters on every
projection and publishes only them; the SGLang servers load each version's adapter
(`/load_lora_adapter`) next to the base they were launched with (docs/lora.md).

Sampler host: the four rollout servers take adapters (the flags after `--` go to SGLang;
`--max-lora-rank` and `--lora-target-modules` must cover `lora.rank` and `lora.targets`, which
the engine checks at start-up); the evaluation server receives the adapters too (the run's
one weight message, docs/transport.md), so it is launched for them as well:

    python scripts/launch_sglang.py --model-path /data/models/Qwen2.5-0.5B-Instruct \
        --num-servers 4 --gpus 0,1,2,3 --base-port 30000 --weight-version 0 -- \
        --enable-lora --max-lora-rank 16 --lora-target-modules all \
        --max-loras-per-batch 4 --max-loaded-loras 8
    python scripts/launch_sglang.py --model-path /data/models/Qwen2.5-0.5B-Instruct \
        --num-servers 1 --gpus 4 --base-port 30004 --nccl-base-port 31004 --weight-version 0 -- \
        --enable-lora --max-lora-rank 16 --lora-target-modules all

Learner host: as configs/qwen2_gsm8k_sglang.py, with this file:

    python experiments/train.py --config=configs/qwen2_gsm8k_sglang_lora.py:gpu8 \
        --workdir=/shared/run_lora --config.model.path=... (the same flags)

The servers must be launched from the learner's base (here `model.path`: no warm start):
every version is an adapter over it. sglang-jax servers are refused at start-up (they have no
/load_lora_adapter: adapters only from --lora-paths at launch). The learning rate is LoRA's
usual ~10x full fine-tuning's; it is not tuned.
"""
from configs import qwen2_gsm8k_sglang


def get_config(arg: str = "gpu8"):
    c = qwen2_gsm8k_sglang.get_config(arg)
    c.lora.enabled = True
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.lora.targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    c.learner.optimizer.learning_rate = 1e-5
    return c
