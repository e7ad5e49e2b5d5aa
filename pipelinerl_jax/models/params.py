"""Flat views of a model's parameters, `{"layers/0/attn/q_proj": array, ...}`, both ways.

This is the weight-sync payload between the learner and the engines (names are the NNX
state paths, values host NumPy arrays in the parameter dtype), and what checkpoints and
tests compare. `hf_io.hf_state_dict` gives the Hugging Face-named view instead.

One function per direction, used by every caller (the learner's publication, the JaxEngine's
weight install, the HF-directory writers of the weight sink and the SGLang engine):

    flat_params(model | nnx.State | pure-dict tree)  -> {name: array}
    state_from_flat(like_state, flat, shardings=...)  -> nnx.State, every name/shape/dtype
                                                         checked (`WeightsMismatch`)
    decoder_from_flat(weights, model_config)           -> a Decoder on host arrays
    LeafSlots(like_state, names).replace(state, flat)  -> a few named arrays swapped in
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pipelinerl_jax.models.model import Decoder


class WeightsMismatch(KeyError, ValueError):
    """Flat weights that do not fit the model: a missing or unknown name, a wrong shape, or
    a dtype of another kind (integers for floating-point parameters). A `ValueError` (and,
    for callers that catch lookups, a `KeyError`) whose message names the parameter."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def path_name(path) -> str:
    """The flat name of a pytree path: "layers/0/attn/q_proj" (the NNX state path)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def flat_params(tree, host: bool = True) -> Dict[str, object]:
    """`{path: array}` of every parameter of a model, an `nnx.State`, or a pure-dict tree of
    arrays (the learner's `state.params`); host NumPy arrays unless `host=False`."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)[0]
    out = {path_name(p): (v.get_value() if _is_var(v) else v) for p, v in leaves}
    if host:
        out = {k: np.asarray(a) for k, a in jax.device_get(out).items()}
    return out


def param_shapes(like_state) -> Dict[str, tuple]:
    """`{name: shape}` of a state (abstract or not): what `state_from_flat` accepts."""
    leaves = jax.tree_util.tree_flatten_with_path(like_state, is_leaf=_is_var)[0]
    return {path_name(p): tuple(v.get_value().shape) for p, v in leaves}


def state_from_flat(like_state: nnx.State, flat: Mapping[str, object],
                    shardings: Optional[nnx.State] = None, keep=frozenset()) -> nnx.State:
    """A state shaped like `like_state` (abstract, e.g. from `nnx.eval_shape`, or holding
    arrays) holding `flat`'s values, cast to `like_state`'s dtypes.

    `flat` must hold exactly `like_state`'s names, with the same shapes and a dtype of the
    same kind (floating / integer / bool), else `WeightsMismatch` naming the first offender.
    Placement: onto `shardings` (a tree like `like_state` whose Variables hold shardings)
    when given; else where `like_state`'s arrays are; else (an abstract `like_state`) host
    NumPy arrays, nothing on a device. The result never aliases `flat`'s buffers (a learner
    may donate them right after handing them over), except the names in `keep`: device
    arrays already in their dtype and place, taken as they are (a LoRA engine's base).
    A host array already in the right dtype is copied once, by the transfer (no cast)."""
    if not isinstance(flat, Mapping):
        raise TypeError(f"weights must be a flat {{name: array}} mapping, got "
                        f"{type(flat).__name__}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like_state, is_leaf=_is_var)
    names = [path_name(p) for p, _ in leaves]
    missing = [n for n in names if n not in flat]
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        raise WeightsMismatch(f"weights do not match the model: missing {missing[:5]}, "
                              f"unknown {extra[:5]}")
    places = [None] * len(leaves) if shardings is None else [
        v.get_value() for v in jax.tree_util.tree_leaves(shardings, is_leaf=_is_var)]
    values, targets = [], []  # host copies / cast device arrays, and where each goes
    for name, (_, var), place in zip(names, leaves, places):
        like = var.get_value()
        if place is None and isinstance(like, jax.Array):
            place = like.sharding
        value = _checked(name, flat[name], like)
        if name in keep:  # taken as it is: already in its dtype and place
            values.append(value)
            place = None
        else:
            values.append(_staged(value, like, place))
        targets.append(place)
    values = reshard(values, targets)
    return jax.tree_util.tree_unflatten(
        treedef, [var.replace(v) for (_, var), v in zip(leaves, values)])


def _checked(name: str, value, like):
    """`value` (an array) if it has `like`'s shape and a dtype of its kind, else
    `WeightsMismatch` naming `name`."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        value = np.asarray(value)
    if tuple(value.shape) != tuple(like.shape):
        raise WeightsMismatch(f"weights: parameter {name!r} has shape "
                              f"{tuple(value.shape)}, the model needs {tuple(like.shape)}")
    if _kind(value.dtype) != _kind(like.dtype):
        raise WeightsMismatch(f"weights: parameter {name!r} has dtype {value.dtype}, the "
                              f"model holds {like.dtype}")
    return value


def _staged(value, like, place):
    """A checked `value` made ready for `reshard` onto `place`: a host copy in `like`'s dtype
    when `place` is None; else a device array cast in the sender's layout, or a host array
    cast only when its dtype differs (the transfer is then its one copy)."""
    if place is None:
        return np.array(value, dtype=like.dtype)  # a host copy
    if isinstance(value, jax.Array):  # (a cast stays in the sender's layout)
        return value if value.dtype == like.dtype else value.astype(like.dtype)
    return np.asarray(value).astype(like.dtype, copy=False)


class LeafSlots:
    """Where the named parameters sit in a state's flat list of arrays, found once, so that
    replacing a few of them (a LoRA engine's adapters, every version) costs work for those
    few: no walk over every name of the state, no rebuilding of the others.

        slots = LeafSlots(like_state, adapter_names, shardings)
        state = slots.replace(live_state, {name: array})   # same checks as state_from_flat

    `live_state` must have `like_state`'s structure (the engine's live state does: it was
    built by `state_from_flat(like_state, ...)`)."""

    def __init__(self, like_state: nnx.State, names, shardings: Optional[nnx.State] = None):
        leaves = jax.tree_util.tree_flatten_with_path(like_state, is_leaf=_is_var)[0]
        if len(jax.tree_util.tree_leaves(like_state)) != len(leaves):
            raise ValueError("a state whose Variables hold one array each was expected")
        index = {path_name(p): i for i, (p, _) in enumerate(leaves)}
        unknown = [n for n in names if n not in index]
        if unknown:
            raise WeightsMismatch(f"weights: {unknown[:5]} are not parameters of the model")
        places = [None] * len(leaves) if shardings is None else [
            v.get_value() for v in jax.tree_util.tree_leaves(shardings, is_leaf=_is_var)]
        self.names, self._count = list(names), len(leaves)
        self._split = self._replicated = None  # a packed transfer's split (`_packed`), made once
        self.positions = [index[n] for n in self.names]
        self.likes = [leaves[i][1].get_value() for i in self.positions]
        self.places = [places[i] if places[i] is not None or not isinstance(like, jax.Array)
                       else like.sharding for i, like in zip(self.positions, self.likes)]

    def replace(self, state: nnx.State, flat: Mapping[str, object]) -> nnx.State:
        """`state` with `flat`'s values (exactly `names`) in their slots, placed with one
        transfer (`_packed`, else one `device_put`); every other array is `state`'s own (no
        copy)."""
        if set(flat) != set(self.names):
            raise WeightsMismatch(f"weights: missing {sorted(set(self.names) - set(flat))[:5]}"
                                  f", unknown {sorted(set(flat) - set(self.names))[:5]}")
        arrays, treedef = jax.tree_util.tree_flatten(state)
        if len(arrays) != self._count:
            raise ValueError(f"the state holds {len(arrays)} arrays, its slots were found in "
                             f"one of {self._count}")
        values = [_staged(_checked(n, flat[n], like), like, place) for n, like, place
                  in zip(self.names, self.likes, self.places)]
        values = self._packed(values) or reshard(values, self.places)
        for i, v in zip(self.positions, values):
            arrays[i] = v
        return jax.tree_util.tree_unflatten(treedef, arrays)

    def _packed(self, values: list) -> Optional[list]:
        """Host arrays of one dtype, all going to one mesh's devices, moved as ONE buffer (one
        transfer instead of one per array: hundreds of small adapters) and split on the
        device by a jitted program made once (`out_shardings`: each slot's); None when that
        does not apply (device arrays, the learner's in-process: already on a device)."""
        if not values or any(not isinstance(v, np.ndarray) for v in values) or \
                len({v.dtype for v in values}) != 1 or \
                not all(isinstance(p, NamedSharding) for p in self.places) or \
                len({p.mesh for p in self.places}) != 1:
            return None
        if self._split is None:
            sizes = [int(v.size) for v in values]
            shapes = [tuple(v.shape) for v in values]
            starts = np.cumsum([0] + sizes[:-1]).tolist()

            def split(buffer):
                return tuple(jax.lax.dynamic_slice_in_dim(buffer, start, size).reshape(shape)
                             for start, size, shape in zip(starts, sizes, shapes))

            self._split = jax.jit(split, out_shardings=tuple(self.places))
            self._replicated = NamedSharding(self.places[0].mesh, PartitionSpec())
        buffer = np.concatenate([v.reshape(-1) for v in values])  # the one host copy
        return list(self._split(jax.device_put(buffer, self._replicated)))


def reshard(values: list, targets: list) -> list:
    """`values` (host arrays, or device arrays in any layout: the learner's) placed onto
    `targets` (shardings; None: stay on the host) with ONE `device_put`, which moves each
    shard straight to the devices the target layout puts it on; never aliasing a device
    input (a learner may donate its buffers right after handing them over)."""
    moved = [i for i, t in enumerate(targets) if t is not None]
    if not moved:
        return list(values)
    out = list(values)
    placed = jax.device_put([values[i] for i in moved], [targets[i] for i in moved],
                            may_alias=False)
    for i, v in zip(moved, placed):
        out[i] = v
    return out


def _kind(dtype) -> str:
    dtype = jnp.dtype(dtype)
    for kind in (jnp.floating, jnp.complexfloating, jnp.integer, jnp.bool_):
        if jnp.issubdtype(dtype, kind):
            return kind.__name__
    return dtype.name


def decoder_from_flat(weights: Any, model_config):
    """A `Decoder` of `model_config` holding `weights` (a flat dict, an `nnx.State` or a
    `Decoder`, returned as is) on host arrays, checked by `state_from_flat`."""
    if isinstance(weights, Decoder):
        return weights
    if isinstance(weights, nnx.State):
        weights = flat_params(weights)
    if not isinstance(weights, Mapping):
        raise TypeError("weights must be a flat {name: array} dict, an nnx.State or a "
                        f"Decoder, got {type(weights).__name__}")
    graphdef, like = nnx.split(nnx.eval_shape(lambda: Decoder(model_config, nnx.Rngs(0))))
    return nnx.merge(graphdef, state_from_flat(like, weights))
