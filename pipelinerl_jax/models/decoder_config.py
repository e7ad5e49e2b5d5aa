"""Decoder configuration for the Llama-3 / Qwen2 / Qwen3 families, and its HF `config.json` form.

The three families differ only in a few switches:

| family | q/k/v bias | o bias | q/k RMSNorm | notes |
|---|---|---|---|---|
| llama (Llama-3) | `attention_bias` | `attention_bias` | no | optional llama3 rope scaling, `mlp_bias` |
| qwen2 | always | no | no | sliding window unsupported |
| qwen3 | `attention_bias` | `attention_bias` | yes (per head) | explicit `head_dim` |

A checkpoint feature we do not implement fails in `from_hf_config` with an error naming the
`config.json` field, rather than loading a model that silently computes something else.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


class CheckpointError(ValueError):
    """A checkpoint or its config cannot be used; the message names the file, field or tensor."""


def dtype_of(name_or_dtype: Any) -> Any:
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {name_or_dtype!r}; valid: {sorted(_DTYPES)}")
        return _DTYPES[name_or_dtype]
    return jnp.dtype(name_or_dtype).type


def dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rope_theta: float = 10000.0
    # llama3-style scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (a mapping or its item pairs); None = plain RoPE.
    rope_scaling: Optional[Any] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    param_dtype: Any = jnp.float32  # storage dtype of the parameters
    dtype: Any = jnp.float32  # compute dtype of matmuls (softmax/norms stay float32)

    def __post_init__(self):
        # Stored as sorted (key, value) pairs so the config stays hashable (it is static
        # metadata of the jitted model graph).
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        def bad(field, msg):
            raise ValueError(f"ModelConfig.{field}: {msg}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                bad(f, f"must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            bad("num_heads", f"{self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.head_dim % 2:
            bad("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            bad("model_type", f"{self.model_type!r} unsupported; valid: {SUPPORTED_MODEL_TYPES}")

    @property
    def num_params(self) -> int:
        d, f, h, k, dh, v = (self.hidden_size, self.intermediate_size, self.num_heads,
                             self.num_kv_heads, self.head_dim, self.vocab_size)
        attn = d * dh * (2 * h + 2 * k) + self.qkv_bias * dh * (h + 2 * k) + self.o_bias * d
        attn += 2 * dh * self.qk_norm
        mlp = 3 * d * f + self.mlp_bias * (2 * f + d)
        per_layer = attn + mlp + 2 * d
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token: 2·(non-embedding matmul params) + attention scores/values."""
        matmul = self.num_params - self.vocab_size * self.hidden_size * (
            0 if self.tie_word_embeddings else 1)
        attn = 2 * 2 * self.num_layers * self.num_heads * self.head_dim * seq_len / 2  # causal
        return 2.0 * matmul + attn

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ HF config.json I/O

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], dtype: Any = jnp.float32,
                       param_dtype: Any = None) -> "ModelConfig":
        """Builds a config from a parsed HF `config.json`; unsupported features name the field."""
        def need(key):
            if key not in hf or hf[key] is None:
                raise CheckpointError(f"config.json: required field {key!r} is missing")
            return hf[key]

        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(f"config.json: model_type {model_type!r} is not supported; "
                                  f"supported: {list(SUPPORTED_MODEL_TYPES)}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("use_sliding_window"):
            raise CheckpointError("config.json: use_sliding_window=true is not supported")
        layer_types = hf.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise CheckpointError(f"config.json: layer_types {sorted(set(layer_types))} "
                                  "unsupported (only full_attention)")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise CheckpointError("config.json: pretraining_tp != 1 is not supported")

        # RoPE: transformers>=5 writes `rope_parameters`; older files `rope_theta`/`rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
        scaling = None
        if rope_type == "llama3":
            src = rope if rope.get("rope_type") == "llama3" else legacy
            keys = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
            missing = [k for k in keys if k not in src]
            if missing:
                raise CheckpointError(f"config.json: rope_scaling (llama3) lacks {missing}")
            scaling = {k: float(src[k]) for k in keys[:3]}
            scaling[keys[3]] = int(src[keys[3]])
        elif rope_type not in ("default", None):
            raise CheckpointError(f"config.json: rope_scaling type {rope_type!r} is not "
                                  "supported (supported: default, llama3)")

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        attention_bias = bool(hf.get("attention_bias", False))
        qkv_bias = {"llama": attention_bias, "qwen2": True, "qwen3": attention_bias}[model_type]
        o_bias = {"llama": attention_bias, "qwen2": False, "qwen3": attention_bias}[model_type]
        eos = hf.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            dtype=dtype_of(dtype),
            param_dtype=dtype_of(param_dtype if param_dtype is not None else dtype),
        )

    def to_hf_config(self) -> dict:
        """The `config.json` dict; loadable by transformers 4.x and 5.x (legacy rope keys)."""
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise CheckpointError("qwen2 requires qkv_bias=True and o_bias=False")
        if self.model_type in ("llama", "qwen3") and self.qkv_bias != self.o_bias:
            raise CheckpointError(f"{self.model_type} ties q/k/v and o biases (attention_bias)")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise CheckpointError("qk_norm is exactly the qwen3 family")
        hf = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype_name(self.param_dtype),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling:
            hf["rope_scaling"] = {"rope_type": "llama3", **dict(self.rope_scaling)}
        if self.model_type in ("llama", "qwen3"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type == "qwen2":
            hf["use_sliding_window"] = False
        return hf


def tiny_config(model_type: str = "llama", **overrides) -> ModelConfig:
    """The default tiny model (~0.4M parameters with a char vocabulary); used by tests/CPU runs."""
    base = dict(vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=32, model_type=model_type,
                max_position_embeddings=256, tie_word_embeddings=True)
    if model_type == "qwen2":
        base["qkv_bias"] = True
    if model_type == "qwen3":
        base["qk_norm"] = True
    base.update(overrides)
    return ModelConfig(**base)


def config_qwen2_5_0_5b(**overrides) -> ModelConfig:
    """Qwen2.5-0.5B's config.json dimensions (494M params, vocab 151936; no eos, so decode
    benchmarks run their full length). Benchmarks build random weights of this shape."""
    base = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                num_heads=14, num_kv_heads=2, head_dim=64, model_type="qwen2", qkv_bias=True,
                tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768,
                rms_norm_eps=1e-6)
    base.update(overrides)
    return ModelConfig(**base)


def config_100m(vocab_size: int = 32000, **overrides) -> ModelConfig:
    """A ~100M-parameter Llama-style config used by benchmarks."""
    base = dict(vocab_size=vocab_size, hidden_size=768, intermediate_size=2048, num_layers=12,
                num_heads=12, num_kv_heads=4, head_dim=64, model_type="llama",
                max_position_embeddings=2048, tie_word_embeddings=True)
    base.update(overrides)
    return ModelConfig(**base)
