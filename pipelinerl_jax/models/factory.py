"""The `model` config section: a tiny/100M preset built from scratch, or a local HF checkpoint;
and `create_model`, a random `Decoder` born in its shardings.

    config.model.init = 'scratch'   # sizes below; vocab from the tokenizer
    config.model.init = 'hf'        # config.model.path = a local HF directory (never a hub id)
"""
from __future__ import annotations

import os

import jax
import ml_collections
from flax import nnx

from pipelinerl_jax import config_checks as C
from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.models.decoder_config import ModelConfig, dtype_of
from pipelinerl_jax.models.hf_io import from_pretrained, load_config
from pipelinerl_jax.models.lora import add_lora
from pipelinerl_jax.models.model import Decoder

MODEL_TYPES = ("llama", "qwen2", "qwen3")


def model_config(**overrides) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(dict(
        init="scratch",  # 'scratch' | 'hf'
        path="",  # HF checkpoint directory when init='hf'
        model_type="llama",
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_seq_len=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        dtype="float32",  # compute dtype ('bfloat16' is the off-CPU default)
        param_dtype="float32",
    ))
    cfg.update(overrides)
    return cfg


def validate_model_config(cfg, prefix: str = "model") -> None:
    C.check_keys(cfg, prefix, model_config().keys())
    init = cfg.init
    if init not in ("scratch", "hf"):
        raise C.ConfigError(f"{prefix}.init", f"must be 'scratch' or 'hf', got {init!r}")
    for key in ("dtype", "param_dtype"):
        if cfg[key] not in ("float32", "bfloat16", "float16"):
            raise C.ConfigError(f"{prefix}.{key}", f"must be float32/bfloat16/float16, "
                                                   f"got {cfg[key]!r}")
    if init == "hf":
        if not cfg.path or not os.path.isdir(cfg.path):
            raise C.ConfigError(f"{prefix}.path", f"init='hf' needs a local checkpoint "
                                                   f"directory, got {cfg.path!r}")
        if not os.path.isfile(os.path.join(cfg.path, "config.json")):
            raise C.ConfigError(f"{prefix}.path", f"{cfg.path} has no config.json")
        return
    if cfg.model_type not in MODEL_TYPES:
        raise C.ConfigError(f"{prefix}.model_type", f"must be one of {MODEL_TYPES}, "
                                                    f"got {cfg.model_type!r}")
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "max_seq_len"):
        _positive(cfg, key, prefix)
    if cfg.num_heads % cfg.num_kv_heads:
        raise C.ConfigError(f"{prefix}.num_heads", f"{cfg.num_heads} is not a multiple of "
                                                   f"num_kv_heads={cfg.num_kv_heads}")
    if cfg.head_dim % 2:
        raise C.ConfigError(f"{prefix}.head_dim", f"must be even for RoPE, got {cfg.head_dim}")


def _positive(cfg, key, prefix):
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise C.ConfigError(f"{prefix}.{key}", f"must be a positive integer, got {v!r}")


def resolve_model_config(cfg, vocab_size: int) -> ModelConfig:
    """The `ModelConfig` a section describes (reads config.json for init='hf')."""
    if cfg.init == "hf":
        mc = load_config(cfg.path, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))
        if mc.vocab_size < vocab_size:
            raise C.ConfigError("model.path", f"checkpoint vocab {mc.vocab_size} is smaller than "
                                              f"the tokenizer's {vocab_size}")
        return mc
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        model_type=cfg.model_type, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope_theta,
        qkv_bias=cfg.model_type == "qwen2", qk_norm=cfg.model_type == "qwen3",
        dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))


def build_model(cfg, vocab_size: int, mesh=None, seed: int = 0,
                rules=sharding_lib.DEFAULT_RULES):
    """A `Decoder` for the section, created or loaded straight into the mesh's shardings."""
    if cfg.init == "hf":
        return from_pretrained(cfg.path, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                               mesh=mesh, rules=rules)
    return create_model(resolve_model_config(cfg, vocab_size), mesh, seed, rules)


def create_model(cfg: ModelConfig, mesh=None, seed: int = 0, rules=sharding_lib.DEFAULT_RULES,
                 lora=None) -> Decoder:
    """A randomly initialised `Decoder` whose parameters are born in their shardings: an
    abstract model from `nnx.eval_shape`, then a jitted init with `out_shardings` (big_vision
    style), so no full copy lands on one device first. With `lora` (a `models.lora.LoRASpec`),
    fresh adapters too (the base is the same as without)."""
    def build():
        model = Decoder(cfg, nnx.Rngs(seed))
        return model if lora is None else add_lora(model, lora, nnx.Rngs(seed + 1))

    abstract = nnx.eval_shape(build)
    graphdef, abs_state = nnx.split(abstract)
    shardings = sharding_lib.state_shardings(abs_state, mesh, rules)

    def init():
        return nnx.state(build())

    return nnx.merge(graphdef, jax.jit(init, out_shardings=shardings)())
