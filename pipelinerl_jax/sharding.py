"""Device mesh and logical-axis sharding rules (MaxText style).

Layers name the logical axes of each parameter (`logical_axes` Variable metadata, e.g.
`("embed", "mlp")`); one rules table maps logical axes to the mesh axes
`('data', 'fsdp', 'tensor')`. Changing a parallelism strategy edits `DEFAULT_RULES` (or passes
other rules), never the model.

    data    pure data parallelism: parameters replicated, batch split
    fsdp    batch split AND parameters sharded along `embed` (ZeRO-3 style: gathered per use)
    tensor  Megatron-style tensor parallelism over heads / mlp / vocab

This module knows no model: `models/` builds on it. Parameters are created
(`models.factory.create_model`) or loaded (`models.hf_io.from_pretrained`) straight into
their shardings: an abstract model from `nnx.eval_shape`, then a jitted init with
`out_shardings` (big_vision style), or a host→devices `device_put` per tensor, so no full copy
ever lands on a single device first.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: tuple = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("seq", None),
    ("lora_rank", None),  # LoRA adapters: A [in..., r], B [r, out...] shard like their base
)


class ShardingError(ValueError):
    """A mesh that does not fit the devices or does not divide a dimension."""


def make_mesh(shape: Sequence[int] = (1, 1, 1), devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A `('data', 'fsdp', 'tensor')` mesh over the first prod(shape) devices."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise ShardingError(f"mesh.shape: need three positive sizes for {MESH_AXES}, got {shape}")
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(shape)
    if n > len(devices):
        raise ShardingError(f"mesh.shape: {shape} needs {n} devices but only {len(devices)} "
                            f"are available ({jax.default_backend()})")
    return Mesh(np.asarray(devices[:n]).reshape(shape), MESH_AXES)


def logical_to_spec(axes: Optional[Sequence[Optional[str]]], rules=DEFAULT_RULES) -> P:
    """Maps logical axis names to a PartitionSpec; unknown names fail loudly."""
    if axes is None:
        return P()
    table = dict(rules)
    out, used = [], set()
    for a in axes:
        if a is None:
            out.append(None)
            continue
        if a not in table:
            raise ShardingError(f"logical axis {a!r} has no sharding rule; known: {sorted(table)}")
        m = table[a]
        mesh_axes = (m,) if isinstance(m, str) else tuple(m or ())
        mesh_axes = tuple(x for x in mesh_axes if x not in used)  # a mesh axis shards one dim
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    while out and out[-1] is None:  # P('x', None) == P('x'): keep the canonical short form
        out.pop()
    return P(*out)


def _check_divisible(name: str, shape, spec: P, mesh: Mesh):
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        parts = math.prod(mesh.shape[a] for a in axes)
        if size % parts:
            raise ShardingError(
                f"mesh.shape: {dict(mesh.shape)} does not divide parameter {name!r} "
                f"dim {dim} (size {size}) over mesh axes {axes} ({parts} parts)")


def _name(path) -> str:
    """A parameter's path as `models.params.flat_params` names it ("layers/0/attn/q_proj")."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def state_shardings(abstract_state, mesh: Optional[Mesh], rules=DEFAULT_RULES):
    """A tree like `abstract_state` whose Variables hold `NamedSharding`s (validated)."""
    if mesh is None:
        mesh = make_mesh((1, 1, 1))

    def one(path, var):
        spec = logical_to_spec(var.get_metadata().get("logical_axes"), rules)
        _check_divisible(_name(path), var.shape, spec, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(
        one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(model_or_state, rules=DEFAULT_RULES) -> dict:
    """`{param path: PartitionSpec}` of a model (for inspection and tests)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    out = {}
    for path, var in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        out[_name(path)] = logical_to_spec(var.get_metadata().get("logical_axes"), rules)
    return out


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of `[B, ...]` batch arrays: rows split over the batch mesh axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",), rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh, rules=DEFAULT_RULES) -> int:
    """How many ways the batch dimension is split (batch sizes must be multiples of it)."""
    spec = logical_to_spec(("batch",), rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[a] for a in axes)
