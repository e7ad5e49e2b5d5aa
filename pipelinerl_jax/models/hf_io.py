"""Hugging Face checkpoint I/O: `config.json` + safetensors (single file or sharded + index).

`from_pretrained(path)` reads tensors straight from memory-mapped safetensors into arrays
placed by the sharding rules (one host→devices `device_put` per tensor; no full copy on one
device first). `save_pretrained(model, path)` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads, which is also how SGLang servers
receive new weights.

The safetensors format is read and written here directly (8-byte little-endian header length,
a JSON header of `{name: {dtype, shape, data_offsets}}`, then raw little-endian bytes) so that
bfloat16 round-trips through `ml_dtypes` without torch. Nothing here unpickles anything.
Kept over the `safetensors` package: it yields zero-copy memory maps with errors that name the
file, and reads as fast (208 MB tensor by tensor: 0.17 s against the package's 0.19 s on the
loaded machine: BENCHMARKS.md, "Hand-written or a library"); the package is only a test
oracle.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models.decoder_config import CheckpointError, ModelConfig, dtype_of
from pipelinerl_jax.models.model import Decoder
from pipelinerl_jax.models.params import (decoder_from_flat, flat_params, param_shapes,
                                          state_from_flat)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# Tensors some exporters add that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- safetensors

def read_safetensors_header(path: str) -> Tuple[dict, int]:
    """Returns (header, data_start_offset); a truncated or corrupt file names itself."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(f"{path}: corrupt safetensors header length {n}")
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    header.pop("__metadata__", None)
    end = 8 + n
    for name, info in header.items():
        try:
            lo, hi = info["data_offsets"]
            dtype = info["dtype"]
            shape = tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from None
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if hi - lo != nbytes or end + hi > size:
            raise CheckpointError(f"{path}: tensor {name!r} data is truncated or inconsistent "
                                  f"(file has {size} bytes)")
    return header, end


def iter_safetensors(path: str) -> Iterator[Tuple[str, np.ndarray]]:
    """Yields (name, memory-mapped array) for every tensor of a file."""
    header, start = read_safetensors_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        arr = mm[start + lo:start + hi].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
        yield name, arr


def write_safetensors(path: str, tensors: Dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    arrays = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _ST_NAMES:
            raise CheckpointError(f"cannot write tensor {name!r} of dtype {arr.dtype}")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        arrays[name] = arr
        offset += arr.nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays.values():
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))


# ----------------------------------------------------------------------------- name mapping

def _layer_map(cfg: ModelConfig, i: int) -> Dict[str, Tuple[str, Callable, Callable]]:
    """HF name -> (our param path, hf->ours transform, ours->hf transform) for layer i."""
    d, h, k, x = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hf, ours = f"model.layers.{i}", f"layers/{i}"

    def proj_in(heads):  # HF [heads*x, d] <-> ours [d, heads, x]
        return (lambda w: w.T.reshape(d, heads, x), lambda w: w.reshape(d, heads * x).T)

    def bias(heads):  # HF [heads*x] <-> ours [heads, x]
        return (lambda b: b.reshape(heads, x), lambda b: b.reshape(heads * x))

    ident = (lambda w: w, lambda w: w)
    transpose = (lambda w: w.T, lambda w: w.T)
    m = {
        f"{hf}.self_attn.q_proj.weight": (f"{ours}/attn/q_proj", *proj_in(h)),
        f"{hf}.self_attn.k_proj.weight": (f"{ours}/attn/k_proj", *proj_in(k)),
        f"{hf}.self_attn.v_proj.weight": (f"{ours}/attn/v_proj", *proj_in(k)),
        # HF o_proj [d, h*x] <-> ours [h, x, d]
        f"{hf}.self_attn.o_proj.weight": (f"{ours}/attn/o_proj",
                                          lambda w: w.T.reshape(h, x, d),
                                          lambda w: w.reshape(h * x, d).T),
        f"{hf}.mlp.gate_proj.weight": (f"{ours}/mlp/gate_proj", *transpose),
        f"{hf}.mlp.up_proj.weight": (f"{ours}/mlp/up_proj", *transpose),
        f"{hf}.mlp.down_proj.weight": (f"{ours}/mlp/down_proj", *transpose),
        f"{hf}.input_layernorm.weight": (f"{ours}/input_norm/weight", *ident),
        f"{hf}.post_attention_layernorm.weight": (f"{ours}/post_attn_norm/weight", *ident),
    }
    if cfg.qkv_bias:
        m[f"{hf}.self_attn.q_proj.bias"] = (f"{ours}/attn/q_bias", *bias(h))
        m[f"{hf}.self_attn.k_proj.bias"] = (f"{ours}/attn/k_bias", *bias(k))
        m[f"{hf}.self_attn.v_proj.bias"] = (f"{ours}/attn/v_bias", *bias(k))
    if cfg.o_bias:
        m[f"{hf}.self_attn.o_proj.bias"] = (f"{ours}/attn/o_bias", *ident)
    if cfg.qk_norm:
        m[f"{hf}.self_attn.q_norm.weight"] = (f"{ours}/attn/q_norm/weight", *ident)
        m[f"{hf}.self_attn.k_norm.weight"] = (f"{ours}/attn/k_norm/weight", *ident)
    if cfg.mlp_bias:
        m[f"{hf}.mlp.gate_proj.bias"] = (f"{ours}/mlp/gate_bias", *ident)
        m[f"{hf}.mlp.up_proj.bias"] = (f"{ours}/mlp/up_bias", *ident)
        m[f"{hf}.mlp.down_proj.bias"] = (f"{ours}/mlp/down_bias", *ident)
    return m


def hf_name_map(cfg: ModelConfig) -> Dict[str, Tuple[str, Callable, Callable]]:
    ident = (lambda w: w, lambda w: w)
    m = {"model.embed_tokens.weight": ("embed", *ident),
         "model.norm.weight": ("final_norm/weight", *ident)}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head", lambda w: w.T, lambda w: w.T)
    for i in range(cfg.num_layers):
        m.update(_layer_map(cfg, i))
    return m


# ----------------------------------------------------------------------------- load / save

def load_config(path: str, dtype: Any = "float32", param_dtype: Any = None) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing config.json")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    return ModelConfig.from_hf_config(hf, dtype=dtype, param_dtype=param_dtype)


def _weight_files(path: str) -> list:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from None
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(path, fn)):
                raise CheckpointError(f"{os.path.join(path, fn)}: shard listed in {INDEX_FILE} "
                                      "is missing")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")


def from_pretrained(path: str, dtype: Any = "float32", param_dtype: Any = None,
                    mesh: Optional[jax.sharding.Mesh] = None,
                    rules=sharding_lib.DEFAULT_RULES) -> Decoder:
    """Loads an HF-format Llama/Qwen2/Qwen3 checkpoint into a `Decoder`.

    `dtype` is the compute dtype; `param_dtype` (default: `dtype`) the storage dtype. With a
    `mesh`, each tensor is placed directly into the sharding its logical axes map to.
    """
    cfg = load_config(path, dtype=dtype_of(dtype),
                      param_dtype=None if param_dtype is None else dtype_of(param_dtype))
    name_map = hf_name_map(cfg)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    shardings = sharding_lib.state_shardings(abs_state, mesh, rules)
    flat_shardings = flat_params(shardings, host=False)
    flat_shapes = param_shapes(abs_state)

    loaded: Dict[str, jax.Array] = {}
    for fn in _weight_files(path):
        for hf_name, arr in iter_safetensors(fn):
            if hf_name not in name_map:
                if hf_name.endswith(_IGNORED_SUFFIXES) or (
                        hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                raise CheckpointError(f"{fn}: unexpected tensor {hf_name!r} for a "
                                      f"{cfg.model_type} config (check config.json)")
            ours, to_ours, _ = name_map[hf_name]
            value = to_ours(np.asarray(arr))
            if tuple(value.shape) != flat_shapes[ours]:
                raise CheckpointError(
                    f"{fn}: tensor {hf_name!r} has shape {tuple(arr.shape)}, which does not fit "
                    f"config.json (expected our {ours!r} to be {flat_shapes[ours]})")
            # placed as it is read (the host holds one tensor at a time)
            loaded[ours] = jax.device_put(value.astype(cfg.param_dtype, copy=False),
                                          flat_shardings[ours])
    missing = [hf for hf, (ours, _, _) in name_map.items() if ours not in loaded]
    if missing:
        raise CheckpointError(f"{path}: checkpoint is missing tensors {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    # the one flat -> state route (`params.state_from_flat`), the arrays kept where they are
    return nnx.merge(graphdef, state_from_flat(abs_state, loaded, keep=set(loaded)))


def hf_state_dict(model_or_state, cfg: ModelConfig, dtype: Any = None) -> Dict[str, np.ndarray]:
    """HF-named host arrays of a model or of its `nnx.State`: what `save_pretrained` writes.
    (Weight sync sends `params.flat_params`, our own names, not this.)"""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    ours = flat_params(state, host=False)
    out = {}
    for hf_name, (our_name, _, to_hf) in hf_name_map(cfg).items():
        arr = np.asarray(jax.device_get(ours[our_name]))
        if dtype is not None:
            arr = arr.astype(dtype)
        out[hf_name] = np.ascontiguousarray(to_hf(arr))
    return out


def save_pretrained(model: Decoder, path: str, max_shard_bytes: int = 2 * 2**30,
                    dtype: Any = None) -> str:
    """Writes `config.json` + safetensors (sharded with an index above `max_shard_bytes`)."""
    cfg = model.cfg
    tensors = hf_state_dict(model, cfg, None if dtype is None else np.dtype(dtype_of(dtype)))
    hf_cfg = cfg.to_hf_config()
    if dtype is not None:
        hf_cfg["torch_dtype"] = np.dtype(dtype_of(dtype)).name
    return write_hf_tensors(path, tensors, hf_cfg, max_shard_bytes)


def write_hf_tensors(path: str, tensors: Dict[str, np.ndarray], hf_config: dict,
                     max_shard_bytes: int = 2 * 2**30) -> str:
    """Writes `config.json` (`hf_config`) and HF-named host `tensors` as safetensors (sharded
    with an index above `max_shard_bytes`) into `path`; returns `path`. The writer behind
    `save_pretrained` and `random_checkpoint.write_random_checkpoint`."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    shards, current, size = [], {}, 0
    for name, arr in tensors.items():
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += arr.nbytes
    shards.append(current)
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        write_safetensors(os.path.join(path, SINGLE_FILE), shards[0])
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fn), shard)
        weight_map.update({name: fn for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path


def write_hf_dir(weights: Any, model_config: ModelConfig, path: str) -> str:
    """Writes `weights` (a flat `{name: array}` dict, an `nnx.State` or a `Decoder`) as the
    HF checkpoint directory of a `model_config` model at `path`; returns `path`.

    The one HF-directory writer: the weight sink's versions and the SGLang engine's
    in-memory updates both go through it. Names, shapes and dtypes are checked by
    `params.state_from_flat`; the model is assembled from host arrays (nothing goes to a
    device). Atomic publication is the caller's (`transport.versioned_dir`)."""
    return save_pretrained(decoder_from_flat(weights, model_config), path)
