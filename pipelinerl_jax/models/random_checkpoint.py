"""Random-weight HF checkpoints drawn on the host with NumPy: no JAX computation, so nothing is
compiled on any backend.

    write_random_checkpoint(cfg, path, seed=0) -> path   # config.json + safetensors
    random_params(cfg, seed=0) -> {our flat name: host array}   # what the checkpoint holds
    python -m pipelinerl_jax.models.random_checkpoint --out DIR [--shape qwen2.5-0.5b] [--seed 0]

Why: the benchmarks of the Qwen2.5-0.5B shape used to build their weights with
`factory.create_model` (one jitted init of the whole model) and save them. On the first
accelerator run (one H200, BENCHMARKS.md "First accelerator run") XLA took over 3 minutes to
compile that init, so every 0.5B-shape benchmark spent its whole time limit making random
weights. Here the values come from `numpy.random.Generator` and go straight to disk; the
benchmarks load them with `hf_io.from_pretrained`, one `device_put` per tensor. Not JAX's CPU
backend instead: under JAX_PLATFORMS=cuda (device_check's setting for its parts)
`xla_bridge.backends()` initialises only the platforms listed, so `jax.devices("cpu")` raises
"Unknown backend cpu" unless the list says "cuda,cpu"; and the same whole-model init compiled
for the CPU still takes tens of seconds (create + save: 35 s + 2 s on this 2-core VM).

Values follow the model's own initialisation (`model._param`): every weight N(0, INIT_STD²)
(drawn in float32), RMSNorm scales 1, biases 0, cast to `cfg.param_dtype`. The names and
shapes are the abstract model's (`nnx.eval_shape`: traced, never compiled or run) mapped to
HF names by `hf_io.hf_name_map`, the table `from_pretrained` reads with. The same `seed` gives
the same bytes whatever the thread count (`hf_random_tensors`); another seed other weights.
The Qwen2.5-0.5B shape (494M parameters, 1.98 GB in float32): 24-27 s on this 2-core VM,
most of it drawing normals, which the threads spread over the cores of a bigger host.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import jax
import numpy as np
from flax import nnx

from pipelinerl_jax.models.decoder_config import (CheckpointError, ModelConfig, config_qwen2_5_0_5b,
                                          tiny_config)
from pipelinerl_jax.models.hf_io import hf_name_map, load_config, write_hf_tensors
from pipelinerl_jax.models.model import INIT_STD, Decoder
from pipelinerl_jax.models.params import param_shapes

# The shapes the benchmarks use, by the name `--shape` takes (bench_real_size's and
# bench_lora's tiny `--smoke` model is "tiny-qwen2").
SHAPES = {"qwen2.5-0.5b": config_qwen2_5_0_5b, "tiny-qwen2": lambda: tiny_config("qwen2")}


def init_kind(name: str) -> str:
    """How `model._param` initialises the parameter of flat name `name`: 'ones' (RMSNorm
    scales, `.../weight`), 'zeros' (biases, `..._bias`) or 'normal' (every other weight)."""
    leaf = name.rsplit("/", 1)[-1]
    if leaf == "weight":
        return "ones"
    if leaf.endswith("_bias"):
        return "zeros"
    return "normal"


CHUNK = 1 << 22  # elements per independently seeded block of a normal tensor


def hf_random_tensors(cfg: ModelConfig, seed: int = 0, workers: int | None = None
                      ) -> Dict[str, np.ndarray]:
    """`{HF name: host array}` of a random `cfg` model at the model's init scales, in
    `cfg.param_dtype` and HF layout (what `write_random_checkpoint` writes, no copy between).

    Normal tensors are filled in blocks of `CHUNK` elements, block j of the i-th tensor (the
    name map's order) from its own stream `SeedSequence(seed, spawn_key=(i, j))`, by
    `workers` threads (default: every core; NumPy's generators release the GIL while they
    fill): the bytes depend on `seed` alone, not on the thread count or schedule."""
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    shapes = param_shapes(abstract)
    name_map = hf_name_map(cfg)
    missing = set(shapes) - {ours for ours, _, _ in name_map.values()}
    if missing:  # a parameter hf_name_map does not know would be missing from the file
        raise CheckpointError(f"no HF name for {sorted(missing)[:5]}")
    out, blocks = {}, []
    for i, (hf, (ours, _, to_hf)) in enumerate(name_map.items()):
        # the HF shape by tracing the same transform save_pretrained applies (nothing runs)
        shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shapes[ours], np.float32)).shape
        kind = init_kind(ours)
        if kind == "normal":
            out[hf] = np.empty(shape, np.float32)
            flat = out[hf].reshape(-1)
            blocks += [(flat[j:j + CHUNK], i, j // CHUNK) for j in range(0, flat.size, CHUNK)]
        else:
            out[hf] = (np.ones if kind == "ones" else np.zeros)(shape, np.float32)

    def fill(block):
        view, i, j = block
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed,
                                                                         spawn_key=(i, j))))
        rng.standard_normal(dtype=np.float32, out=view)
        view *= np.float32(INIT_STD)

    with ThreadPoolExecutor(max(1, workers or os.cpu_count() or 1)) as pool:
        list(pool.map(fill, blocks))
    dtype = np.dtype(cfg.param_dtype)
    return {hf: a.astype(dtype, copy=False) for hf, a in out.items()}


def random_params(cfg: ModelConfig, seed: int = 0) -> Dict[str, np.ndarray]:
    """`{our flat name: host array}`: the weights of `write_random_checkpoint(cfg, ...,
    seed)` as `from_pretrained` lays them out."""
    tensors = hf_random_tensors(cfg, seed)
    return {ours: to_ours(tensors[hf]) for hf, (ours, to_ours, _) in hf_name_map(cfg).items()}


def write_random_checkpoint(cfg: ModelConfig, path: str, seed: int = 0,
                            workers: int | None = None) -> str:
    """Writes a random `cfg` model as an HF checkpoint directory at `path` (`config.json` +
    safetensors, loadable by `from_pretrained` and transformers); returns `path`. Written
    beside `path` and renamed into place, so a killed writer leaves no half checkpoint that a
    rerun would take for a whole one; an existing `path` is replaced."""
    tensors = hf_random_tensors(cfg, seed, workers)
    path = os.path.abspath(path)
    tmp = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf_tensors(tmp, tensors, cfg.to_hf_config())
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


def _shape_fields(cfg: ModelConfig) -> dict:
    hf = cfg.to_hf_config()
    hf.pop("torch_dtype")  # storage, not shape: from_pretrained casts to what it is asked for
    return hf


def check_checkpoint_shape(path: str, cfg: ModelConfig) -> ModelConfig:
    """`path`'s config (`load_config`) when it describes the same model as `cfg` (every
    `config.json` field but the storage dtype), else `CheckpointError` naming the fields that
    differ: a benchmark handed a checkpoint of another shape says so instead of timing it."""
    have = load_config(path)
    a, b = _shape_fields(have), _shape_fields(cfg)
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    if diff:
        raise CheckpointError(f"{path}: not the expected model shape; config.json vs expected: "
                              f"{diff}")
    return have


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the "
                                                             "shape's)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = SHAPES[a.shape]()
    if a.layers:
        cfg = cfg.replace(num_layers=a.layers)
    t = time.perf_counter()
    path = write_random_checkpoint(cfg, a.out, a.seed)
    write_s = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    out = {"path": path, "shape": a.shape, "layers": cfg.num_layers, "seed": a.seed,
           "params": cfg.num_params, "bytes": size, "write_s": round(write_s, 1)}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
