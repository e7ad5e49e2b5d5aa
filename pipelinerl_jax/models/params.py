"""Flat views of a model's parameters: `{"layers/0/attn/q_proj": array, ...}`.

This is the weight-sync payload between the learner and embedded engines (names are the
NNX state paths, values host NumPy arrays in the parameter dtype), and what checkpoints
and tests compare. `hf_io.hf_state_dict` gives the Hugging Face-named view instead.
"""
from __future__ import annotations

from typing import Dict, Mapping

import jax
import numpy as np
from flax import nnx

from pipelinerl_jax.sharding import path_name


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def flat_params(model_or_state, host: bool = True) -> Dict[str, object]:
    """`{path: array}` of every parameter; host NumPy copies unless `host=False`."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(
        model_or_state, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]
    out = {path_name(p): v.get_value() for p, v in leaves}
    if host:
        out = {k: np.asarray(a) for k, a in jax.device_get(out).items()}
    return out


def state_from_flat(like_state: nnx.State, flat: Mapping[str, object]) -> nnx.State:
    """A state shaped like `like_state`, holding `flat`'s arrays placed with its shardings.

    Every name must be present with the same shape; dtypes are cast to the existing ones.
    """
    def one(p, var):
        name = path_name(p)
        if name not in flat:
            raise KeyError(f"weights are missing parameter {name!r}")
        cur = var.get_value()
        new = flat[name]
        if tuple(new.shape) != tuple(cur.shape):
            raise ValueError(f"parameter {name!r}: shape {tuple(new.shape)} != {tuple(cur.shape)}")
        arr = np.asarray(new) if not isinstance(new, jax.Array) else new
        return var.replace(jax.device_put(arr.astype(cur.dtype), cur.sharding))

    extra = set(flat) - {path_name(p) for p, _ in
                         jax.tree_util.tree_flatten_with_path(like_state, is_leaf=_is_var)[0]}
    if extra:
        raise KeyError(f"weights have unknown parameters {sorted(extra)[:5]}")
    return jax.tree_util.tree_map_with_path(one, like_state, is_leaf=_is_var)
