"""Weights given to `SGLangEngine.update_weights` as arrays, written as an HF version directory.

The pipeline's learner already writes `weights_dir/v{version:08d}` itself and hands the
engine that path; this covers callers that hold the weights in memory (a flat
`{state path: array}` dict, an `nnx.State` or a `Decoder`). The directory appears atomically
(`write_versioned_dir`), so a server never loads half a version.
"""
from __future__ import annotations

from typing import Any, Mapping

from flax import nnx

from pipelinerl_jax.models import Decoder, flat_params, save_pretrained, state_from_flat
from pipelinerl_jax.transport.versioned_dir import write_versioned_dir


def as_decoder(weights: Any, model_config) -> Decoder:
    """A `Decoder` holding `weights` (flat dict, `nnx.State` or `Decoder`)."""
    if isinstance(weights, Decoder):
        return weights
    if isinstance(weights, nnx.State):
        weights = flat_params(weights)
    if not isinstance(weights, Mapping):
        raise TypeError("weights must be a checkpoint path, a flat {path: array} dict, an "
                        f"nnx.State or a Decoder, got {type(weights).__name__}")
    abstract = nnx.eval_shape(lambda: Decoder(model_config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return nnx.merge(graphdef, state_from_flat(state, weights))


def write_hf_version(weights: Any, model_config, root: str, version: int) -> str:
    """Writes `weights` to `root/v{version:08d}` (replacing an older copy); returns it."""
    model = as_decoder(weights, model_config)
    return write_versioned_dir(root, version, lambda tmp: save_pretrained(model, tmp),
                               overwrite=True)
