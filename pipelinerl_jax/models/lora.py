"""LoRA adapters on the decoder's projections (docs/lora.md): attach, split, merge.

An adapted projection `W` (shape `in_shape + out_shape`, e.g. q_proj `[D, H, X]`) gains two
`nnx.LoRAParam`s on its module, named after it:

    <proj>_lora_a   in_shape + (r,)    logical axes: W's input axes + ("lora_rank",)
    <proj>_lora_b   (r,) + out_shape   logical axes: ("lora_rank",) + W's output axes

and the forward adds `scale · (x·A)·B` to `x·W` (`model.lora_delta`), `scale = alpha / r`.
A is random, B zero, so a freshly adapted model computes exactly what its base does. The
adapter arrays are ordinary NNX state: their flat names are their NNX paths
(`layers/0/attn/q_proj_lora_a`), as for every other weight (`models.params`), and
`sharding.state_shardings` shards them like their base (A by its input axes, B by its output
axes; the rank is never split).

    spec = LoRASpec(rank=16, alpha=32.0, targets=("q_proj", "v_proj"))
    add_lora(model, spec, nnx.Rngs(0))        # in place; the base is untouched
    adapter_params(model)  -> {"layers/0/attn/q_proj_lora_a": array, ...}
    base_params(model)     -> the frozen weights only
    merge_lora(base_flat, adapters, spec.scale) -> base names, W + scale·A@B in float32,
                                                   cast back to each W's dtype
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import math
import os
from typing import Dict, Mapping, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.config_checks import ConfigError, check_keys
from pipelinerl_jax.models.params import WeightsMismatch, flat_params

# target name -> (the block's submodule, how many leading axes of W are its input)
TARGETS: Dict[str, Tuple[str, int]] = {
    "q_proj": ("attn", 1), "k_proj": ("attn", 1), "v_proj": ("attn", 1),
    "o_proj": ("attn", 2),  # [H, X, D]: the input is every head's values
    "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1), "down_proj": ("mlp", 1),
}
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
RANK_AXIS = "lora_rank"
BASE_FILTER = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # the frozen weights


def lora_config() -> ml_collections.ConfigDict:
    """The run config's `lora` section (validated by `validate_lora_config`)."""
    return ml_collections.ConfigDict(dict(
        enabled=False,
        rank=16,
        alpha=32.0,  # the update is (alpha / rank) · A @ B
        targets=",".join(TARGETS),  # comma-separated projection names
    ))


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: Tuple[str, ...] = tuple(TARGETS)

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)


def parse_targets(targets) -> Tuple[str, ...]:
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return tuple(targets)


def validate_lora_config(c, prefix: str = "lora") -> None:
    """Raises `ConfigError` naming the first bad key of a `lora` section."""
    check_keys(c, prefix, lora_config().keys())
    if not isinstance(c.enabled, bool):
        raise ConfigError(f"{prefix}.enabled", f"must be True or False, got {c.enabled!r}")
    if isinstance(c.rank, bool) or not isinstance(c.rank, int) or c.rank < 1:
        raise ConfigError(f"{prefix}.rank", f"must be an integer >= 1, got {c.rank!r}")
    if (isinstance(c.alpha, bool) or not isinstance(c.alpha, (int, float))
            or not math.isfinite(c.alpha) or c.alpha <= 0):
        raise ConfigError(f"{prefix}.alpha", f"must be a positive number, got {c.alpha!r}")
    if not isinstance(c.targets, (str, tuple, list)):
        raise ConfigError(f"{prefix}.targets", "must be comma-separated projection names, got "
                                               f"{c.targets!r}")
    targets = parse_targets(c.targets)
    if not targets:
        raise ConfigError(f"{prefix}.targets", f"names no projection; valid: {list(TARGETS)}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ConfigError(f"{prefix}.targets", f"unknown projection(s) {unknown}; valid: "
                                               f"{list(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise ConfigError(f"{prefix}.targets", f"names a projection twice: {list(targets)}")


def lora_spec(cfg):
    """The `LoRASpec` of a run config with `lora.enabled`, else None (also for a config
    saved before the section existed)."""
    if "lora" not in cfg or not cfg.lora.enabled:
        return None
    return spec_from_config(cfg.lora)


def spec_from_config(c) -> LoRASpec:
    """The `LoRASpec` of a validated `lora` section."""
    return LoRASpec(rank=int(c.rank), alpha=float(c.alpha), targets=parse_targets(c.targets))


def _targets_of(model, spec: LoRASpec):
    """(module, projection name, n input axes) for each adapted projection of `model`."""
    for layer in model.layers:
        for name in spec.targets:
            sub, n_in = TARGETS[name]
            yield getattr(layer, sub), name, n_in


def add_lora(model, spec: LoRASpec, rngs: nnx.Rngs):
    """Attaches zero-effect adapters (A ~ N(0, 1/in), B = 0) to `spec.targets` of every
    layer of `model` (a `Decoder`), in the base's parameter dtype; returns `model`."""
    for module, name, n_in in _targets_of(model, spec):
        w = getattr(module, name)
        axes = w.get_metadata().get("logical_axes") or (None,) * w.ndim
        in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
        if spec.rank > min(math.prod(in_shape), math.prod(out_shape)):
            raise ConfigError("lora.rank", f"{spec.rank} exceeds the smaller side of {name} "
                                           f"{tuple(w.shape)}")
        dtype = w.get_value().dtype
        a = jax.random.normal(rngs.params(), in_shape + (spec.rank,), jnp.float32)
        a = a / math.sqrt(math.prod(in_shape))
        setattr(module, name + SUFFIX_A, nnx.LoRAParam(
            a.astype(dtype), logical_axes=tuple(axes[:n_in]) + (RANK_AXIS,)))
        setattr(module, name + SUFFIX_B, nnx.LoRAParam(
            jnp.zeros((spec.rank,) + out_shape, dtype),
            logical_axes=(RANK_AXIS,) + tuple(axes[n_in:])))
        module.lora_scale = spec.scale
    return model


def attach_lora(model, spec: LoRASpec, mesh, seed: int = 0):
    """`add_lora`, then each adapter placed in its sharding on `mesh` (the rules of
    `pipelinerl_jax.sharding`). The values are drawn once on the host, the same on every
    process, and each process puts only its own shards (multi-process learners)."""
    add_lora(model, spec, nnx.Rngs(seed))
    adapters = nnx.state(model, nnx.LoRAParam)
    shardings = sharding_lib.state_shardings(adapters, mesh)

    def place(var, sh):
        host = np.asarray(jax.device_get(var.get_value()))
        return var.replace(jax.make_array_from_callback(
            host.shape, sh.get_value(), lambda idx, host=host: host[idx]))

    nnx.update(model, jax.tree.map(place, adapters, shardings,
                                   is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return model


def adapter_params(tree, host: bool = True) -> Dict[str, object]:
    """The adapter-only flat dict (`{"layers/0/attn/q_proj_lora_a": array, ...}`) of a model,
    or of a flat dict / state holding adapters among other weights."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.LoRAParam)
    flat = tree if isinstance(tree, Mapping) and not isinstance(tree, nnx.State) \
        else flat_params(tree, host=host)
    return {k: v for k, v in flat.items() if is_adapter_name(k)}


def base_params(model, host: bool = True) -> Dict[str, object]:
    """The flat dict of `model`'s frozen (non-adapter) weights."""
    return flat_params(nnx.state(model, BASE_FILTER), host=host)


def is_adapter_name(name: str) -> bool:
    return name.endswith(SUFFIX_A) or name.endswith(SUFFIX_B)


def adapter_shapes(base_shapes: Mapping[str, tuple], spec: LoRASpec) -> Dict[str, tuple]:
    """`{adapter name: shape}` for `spec` over a model whose flat weight shapes are
    `base_shapes` (what an engine holding that base accepts)."""
    out = {}
    for name, shape in base_shapes.items():
        proj = name.rsplit("/", 1)[-1]
        if proj not in spec.targets:
            continue
        n_in = TARGETS[proj][1]
        out[name + SUFFIX_A] = tuple(shape[:n_in]) + (spec.rank,)
        out[name + SUFFIX_B] = (spec.rank,) + tuple(shape[n_in:])
    return out


def merge_lora(base: Mapping[str, object], adapters: Mapping[str, object],
               scale: float) -> Dict[str, object]:
    """`base` with every adapted weight replaced by `W + scale · A @ B`, computed in float32
    and cast to W's dtype (jax arrays; the others are passed through as they are).

    `adapters` must come in A/B pairs whose base `base` holds, with matching shapes (A: W's
    input axes + r, B: r + W's output axes, one r); else `WeightsMismatch` naming the adapter."""
    out = dict(base)
    for name in sorted(adapters):
        if not is_adapter_name(name):
            raise WeightsMismatch(f"adapters: {name!r} is not an adapter weight (names end in "
                                  f"{SUFFIX_A!r} or {SUFFIX_B!r})")
    for name_a in sorted(n for n in adapters if n.endswith(SUFFIX_A)):
        target = name_a[:-len(SUFFIX_A)]
        name_b = target + SUFFIX_B
        if name_b not in adapters:
            raise WeightsMismatch(f"adapters: {name_a!r} comes without {name_b!r}")
        if target not in base:
            raise WeightsMismatch(f"adapters: {name_a!r} adapts {target!r}, which the base "
                                  f"does not hold")
        w, a, b = base[target], adapters[name_a], adapters[name_b]
        n_in = a.ndim - 1
        if (a.ndim < 2 or b.ndim < 2 or tuple(a.shape[:n_in]) != tuple(w.shape[:n_in])
                or tuple(b.shape[1:]) != tuple(w.shape[n_in:]) or a.shape[-1] != b.shape[0]):
            raise WeightsMismatch(f"adapters: {name_a!r} {tuple(a.shape)} and {name_b!r} "
                                  f"{tuple(b.shape)} do not fit {target!r} {tuple(w.shape)} "
                                  f"(A: input axes + rank, B: rank + output axes)")
        delta = jnp.tensordot(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), 1)
        out[target] = (jnp.asarray(w, jnp.float32) + scale * delta).astype(w.dtype)
    orphans = [n for n in adapters if n.endswith(SUFFIX_B)
               and n[:-len(SUFFIX_B)] + SUFFIX_A not in adapters]
    if orphans:
        raise WeightsMismatch(f"adapters: {orphans[0]!r} comes without its A")
    return out


def merged_params(model, spec: LoRASpec, host: bool = True) -> Dict[str, object]:
    """The flat weights of `model`'s base with its adapters merged in (no adapter names)."""
    merged = merge_lora(base_params(model, host=False), adapter_params(model, host=False),
                        spec.scale)
    if host:
        merged = {k: np.asarray(v) for k, v in jax.device_get(merged).items()}
    return merged


def base_identity(checkpoint: str) -> Dict[str, str]:
    """`{"path", "sha256"}` of an HF checkpoint directory (its config and every safetensors
    file, in name order): what a LoRA checkpoint records of the base its adapters belong to."""
    files = [os.path.join(checkpoint, "config.json")] + sorted(
        glob.glob(os.path.join(checkpoint, "*.safetensors")))
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return {"path": os.path.abspath(checkpoint), "sha256": digest.hexdigest()}
