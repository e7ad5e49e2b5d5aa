"""Hardware and model descriptions for the systems simulator, with public presets.

An `Accelerator` is what one device offers a model; a `ModelSpec` is what a decoder costs per
token. Units are SI (bytes, bytes/s, FLOP/s); config files speak GB, GB/s and TFLOP/s and are
converted in `sim/sim_config.py`.

Accelerator presets use the vendors' public datasheet numbers (dense bf16, no sparsity):
  h100     NVIDIA H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s.
  h200     NVIDIA H200 SXM:  141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s.
  tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e   Cloud TPU chips, from `aot/chips.py`'s table.
  cpu      this development machine (2 cores of an AMD EPYC, 24 GiB), MEASURED, see
           `measure_cpu`: float32 2048x2048 matmul, best of 5 = 79.5 GFLOP/s; 256 MiB
           float32 `np.copyto`, best of 5, counting bytes read + written = 31.6 GB/s.
           Noisy (the machine is shared); re-measure with `measure_cpu()`.
The achievable fractions (`mbu`: share of HBM bandwidth a decode step reaches; `mfu`: share
of peak FLOP/s a compute-bound decode/prefill reaches; `train_mfu`: the same for the train
step; `hbm_util`: share of HBM the engine may use, vLLM/SGLang's `mem_fraction`) are
typical published values, not datasheet numbers; calibrate them from a run
(`sim/calibrate.py`) when you have one.

Model presets are the public configs of the Hugging Face checkpoints (layers, attention and
KV heads, head dim); `params` is the total parameter count.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from pipelinerl_jax.aot.chips import CHIPS


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: float  # memory per device
    hbm_bw: float  # bytes/s per device
    peak_flops: float  # dense FLOP/s per device (bf16 on accelerators, f32 on the CPU)
    mfu: float = 0.5  # achievable fraction of peak in compute-bound decode/prefill
    mbu: float = 0.8  # achievable fraction of hbm_bw in memory-bound decode
    train_mfu: float = 0.4  # achievable fraction of peak in the train step
    hbm_util: float = 0.9  # fraction of HBM the inference engine may use


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float  # parameter count
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    weight_bytes: float = 2.0  # bytes per parameter as served (bf16)
    kv_bytes: float = 2.0  # bytes per cached K or V value

    @property
    def weights_total_bytes(self) -> float:
        return self.params * self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer: 2 · layers · kv_heads · head_dim · kv_bytes."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def attn_flops_per_token_per_ctx(self) -> float:
        """Decode attention FLOPs per generated token per cached token: QKᵀ and AV, 2 FLOPs
        per multiply-add each, over every query head: 4 · layers · heads · head_dim."""
        return 4.0 * self.layers * self.heads * self.head_dim


ACCELERATORS = {
    "h100": Accelerator("h100", hbm_bytes=80e9, hbm_bw=3.35e12, peak_flops=989e12),
    "h200": Accelerator("h200", hbm_bytes=141e9, hbm_bw=4.8e12, peak_flops=989e12),
    # Cloud TPU chips: the one table of `pipelinerl_jax/aot/chips.py` (sources there).
    **{f"tpu-{c.name}": Accelerator(f"tpu-{c.name}", hbm_bytes=c.hbm_bytes, hbm_bw=c.hbm_bw,
                                    peak_flops=c.peak_bf16_flops) for c in CHIPS.values()},
    # Measured here by `measure_cpu()` (see the module docstring). numpy reaches most of its
    # matmul peak on a 2048² product and a streaming copy is what a decode step does to its
    # weights, so the achievable fractions are set high.
    "cpu": Accelerator("cpu", hbm_bytes=24 * 2**30, hbm_bw=31.6e9, peak_flops=79.5e9,
                       mfu=0.8, mbu=0.9, train_mfu=0.3, hbm_util=0.5),
}

MODELS = {
    "qwen2.5-0.5b": ModelSpec("qwen2.5-0.5b", 0.494e9, layers=24, heads=14, kv_heads=2, head_dim=64),
    "qwen2.5-1.5b": ModelSpec("qwen2.5-1.5b", 1.54e9, layers=28, heads=12, kv_heads=2, head_dim=128),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7.62e9, layers=28, heads=28, kv_heads=4, head_dim=128),
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 8.03e9, layers=32, heads=32, kv_heads=8, head_dim=128),
    "qwen3-8b": ModelSpec("qwen3-8b", 8.19e9, layers=36, heads=32, kv_heads=8, head_dim=128),
    "qwen3-32b": ModelSpec("qwen3-32b", 32.8e9, layers=64, heads=64, kv_heads=8, head_dim=128),
    # The project's tiny from-scratch decoder as run on the CPU (float32 weights and cache).
    "tiny": ModelSpec("tiny", 5e6, layers=4, heads=4, kv_heads=2, head_dim=32,
                      weight_bytes=4.0, kv_bytes=4.0),
}


def measure_cpu(n: int = 2048, copy_mib: int = 256, repeats: int = 5) -> dict:
    """Measures this machine: float32 matmul FLOP/s and streaming memory bandwidth.

    FLOP/s = 2·n³ / best time of `a @ b` with float32 [n, n] operands (numpy's BLAS, all
    cores). Bandwidth = 2·bytes / best time of `np.copyto` between two `copy_mib` MiB float32
    buffers (each byte is read once and written once), i.e. what a decode step streaming its
    weights sees. Best-of-`repeats` filters out other processes on a shared machine.
    """
    rng = np.random.default_rng(0)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    a @ b  # warm the BLAS threads
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    flops = 2.0 * n**3 / best
    x = np.ones(copy_mib * 2**20 // 4, np.float32)
    y = np.empty_like(x)
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(y, x)
        best = min(best, time.perf_counter() - t)
    return {"peak_flops": flops, "hbm_bw": 2.0 * x.nbytes / best}
