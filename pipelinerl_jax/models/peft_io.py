"""LoRA adapters as PEFT adapter directories, and merged HF checkpoints (docs/lora.md: Export).

A PEFT LoRA directory (what `peft.PeftModel.from_pretrained(hf_model, path)` and SGLang's
`/load_lora_adapter` read) holds

    adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, ...
    adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight  [r, in]
                                base_model.model.<HF module>.lora_B.weight  [out, r]

where `<HF module>` is the HF name of the adapted Linear (`model.layers.3.self_attn.q_proj`)
and PEFT's forward adds `(lora_alpha / r) · B(A(x))` to the Linear's output: the update
`(alpha / r) · A @ B` of ours with A and B flattened to 2-D and transposed. Our A is
`in_shape + (r,)` and our B `(r,) + out_shape` (`models.lora`); HF's Linear flattens the
same axes in the same (row-major) order (`hf_io._layer_map`: q_proj `[D, H, X]` is HF
`[H*X, D]` transposed, o_proj `[H, X, D]` is HF `[D, H*X]` transposed), so

    PEFT lora_A = A.reshape(prod(in_shape), r).T      PEFT lora_B = B.reshape(r, prod(out)).T

The module names come from `hf_io.hf_name_map`, the mapping every HF checkpoint goes
through, so an adapter lands on the Linear its base weight was written to.

    write_peft_dir(adapters, model_config, spec, path, base_model="/models/base")
    read_peft_dir(path, model_config) -> (adapters, spec)      # the inverse, exact
    write_merged_dir(adapters, spec, base_checkpoint, path)    # W + scale·A@B (float32)
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, Mapping, Optional, Tuple

import jax
import numpy as np
from flax import nnx

from pipelinerl_jax.models.decoder_config import CheckpointError, ModelConfig, dtype_of
from pipelinerl_jax.models.hf_io import (from_pretrained, hf_name_map, iter_safetensors,
                                         load_config, write_hf_dir, write_safetensors)
from pipelinerl_jax.models.lora import (SUFFIX_A, SUFFIX_B, TARGETS, LoRASpec,
                                        adapter_shapes, is_adapter_name, merge_lora)
from pipelinerl_jax.models.model import Decoder
from pipelinerl_jax.models.params import WeightsMismatch, flat_params, param_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model as base_model.model


def _base_shapes(model_config: ModelConfig) -> Dict[str, tuple]:
    abstract = nnx.eval_shape(lambda: Decoder(model_config, nnx.Rngs(0)))
    return param_shapes(nnx.state(abstract, nnx.Param))


def peft_module_names(model_config: ModelConfig) -> Dict[str, str]:
    """`{our weight name: HF module name}` of every projection a LoRA target can name
    (`layers/0/attn/q_proj` -> `model.layers.0.self_attn.q_proj`)."""
    out = {}
    for hf_name, (ours, _, _) in hf_name_map(model_config).items():
        if ours.rsplit("/", 1)[-1] in TARGETS and hf_name.endswith(".weight"):
            out[ours] = hf_name[:-len(".weight")]
    return out


def _check_adapters(adapters: Mapping[str, object], model_config: ModelConfig,
                    spec: LoRASpec) -> None:
    want = adapter_shapes(_base_shapes(model_config), spec)
    unknown = sorted(n for n in adapters if not is_adapter_name(n) or n not in want)
    missing = sorted(n for n in want if n not in adapters)
    if unknown or missing:
        raise WeightsMismatch(f"adapters do not match {list(spec.targets)} at rank "
                              f"{spec.rank} on this model: missing {missing[:5]}, unknown "
                              f"{unknown[:5]}")
    for name, shape in want.items():
        if tuple(np.shape(adapters[name])) != shape:
            raise WeightsMismatch(f"adapters: {name!r} has shape "
                                  f"{tuple(np.shape(adapters[name]))}, expected {shape}")


def peft_tensors(adapters: Mapping[str, object], model_config: ModelConfig,
                 spec: LoRASpec, dtype=None) -> Dict[str, np.ndarray]:
    """PEFT-named 2-D host arrays of an adapter-only flat dict (checked against
    `model_config` and `spec`: every target of every layer, at `spec.rank`)."""
    _check_adapters(adapters, model_config, spec)
    modules = peft_module_names(model_config)
    out = {}
    for name in sorted(adapters):
        arr = np.asarray(adapters[name])
        if dtype is not None:
            arr = arr.astype(dtype_of(dtype))
        if name.endswith(SUFFIX_A):
            target, kind = name[:-len(SUFFIX_A)], "lora_A"
            flat = arr.reshape(-1, spec.rank).T  # [r, in]
        else:
            target, kind = name[:-len(SUFFIX_B)], "lora_B"
            flat = arr.reshape(spec.rank, -1).T  # [out, r]
        out[f"{PEFT_PREFIX}{modules[target]}.{kind}.weight"] = np.ascontiguousarray(flat)
    return out


def peft_config(spec: LoRASpec, base_model: Optional[str] = None) -> dict:
    """`adapter_config.json` for `spec`: PEFT's `LoraConfig` fields (plain LoRA: no dropout,
    no bias, no rsLoRA/DoRA; PEFT's scaling `lora_alpha / r` is ours, `alpha / rank`)."""
    alpha = float(spec.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(spec.rank),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_peft_dir(adapters: Mapping[str, object], model_config: ModelConfig,
                   spec: LoRASpec, path: str, base_model: Optional[str] = None,
                   dtype=None) -> str:
    """Writes the PEFT adapter directory of `adapters` (our flat adapter dict) at `path`;
    returns `path`. `base_model` goes to `base_model_name_or_path` (the HF base directory or
    hub id); `dtype` casts the tensors (default: as they are)."""
    tensors = peft_tensors(adapters, model_config, spec, dtype)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, ADAPTER_WEIGHTS), tensors)
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(spec, base_model), f, indent=2)
    return path


def read_peft_config(path: str) -> Tuple[LoRASpec, dict]:
    """The `LoRASpec` of a PEFT LoRA directory and its raw `adapter_config.json`; a variant
    we do not compute (dropout aside: rsLoRA, DoRA, per-module ranks, biases, a non-LoRA
    type) is refused naming the field."""
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: unreadable adapter config ({e})") from None
    if raw.get("peft_type") != "LORA":
        raise CheckpointError(f"{cfg_path}: peft_type {raw.get('peft_type')!r}, not 'LORA'")
    for key, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none"),
                       ("fan_in_fan_out", False), ("rank_pattern", {}),
                       ("alpha_pattern", {})):
        if raw.get(key, plain) not in (plain, None):
            raise CheckpointError(f"{cfg_path}: {key}={raw[key]!r} is not plain LoRA")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets or any(t not in TARGETS for t in targets):
        raise CheckpointError(f"{cfg_path}: target_modules {targets!r} must list names among "
                              f"{list(TARGETS)}")
    order = {t: i for i, t in enumerate(TARGETS)}
    spec = LoRASpec(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                    targets=tuple(sorted(targets, key=order.get)))
    return spec, raw


def read_peft_dir(path: str, model_config: ModelConfig) -> Tuple[Dict[str, np.ndarray],
                                                                  LoRASpec]:
    """The inverse of `write_peft_dir`: our flat adapter dict (host arrays) and its spec."""
    spec, _ = read_peft_config(path)
    shapes = adapter_shapes(_base_shapes(model_config), spec)
    by_peft = {f"{PEFT_PREFIX}{m}": ours for ours, m in peft_module_names(model_config).items()}
    out = {}
    for key, arr in iter_safetensors(os.path.join(path, ADAPTER_WEIGHTS)):
        module, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or module not in by_peft:
            raise CheckpointError(f"{path}: unexpected tensor {key!r}")
        name = by_peft[module] + (SUFFIX_A if kind[0] == "A" else SUFFIX_B)
        if name not in shapes:
            raise CheckpointError(f"{path}: {key!r} adapts a module outside target_modules")
        shape = shapes[name]
        want_2d = ((spec.rank, math.prod(shape[:-1])) if kind[0] == "A"
                   else (math.prod(shape[1:]), spec.rank))
        if tuple(arr.shape) != want_2d:
            raise CheckpointError(f"{path}: {key!r} has shape {tuple(arr.shape)}, expected "
                                  f"{want_2d} (rank {spec.rank})")
        out[name] = np.ascontiguousarray(np.asarray(arr).T).reshape(shape)
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise CheckpointError(f"{path}: missing adapters {missing[:5]}")
    return out, spec


def write_merged_dir(adapters: Mapping[str, object], spec: LoRASpec, base_checkpoint: str,
                     path: str, dtype="float32") -> str:
    """Writes the HF checkpoint of `base_checkpoint` with `adapters` merged in
    (`W + scale · A @ B` in float32, `models.lora.merge_lora`), stored in `dtype`, at `path`
    (through `write_hf_dir`, the one HF writer); returns `path`."""
    base = flat_params(from_pretrained(base_checkpoint, dtype=dtype, param_dtype=dtype))
    merged = merge_lora(base, {k: np.asarray(v) for k, v in adapters.items()}, spec.scale)
    host = {k: np.asarray(v) for k, v in jax.device_get(merged).items()}
    return write_hf_dir(host, load_config(base_checkpoint, dtype=dtype_of(dtype),
                                          param_dtype=dtype_of(dtype)), path)
