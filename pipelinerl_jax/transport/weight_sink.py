"""Where the learner's weights go: one small interface, two ways of delivering them.

    sink = make_weight_sink(kind, cfg, workdir, init_checkpoint=path)    # the launcher
    sink.publish(version, params_flat, policy_version=None)               # the learner, per step
    sink.close()

- `StreamSink` ('stream'): the flat host arrays over the gRPC weight stream
  (`WeightPublisher`); embedded engines (JaxEngine) install them from memory.
- `NullSink`: delivers nothing; what every learner process but the first holds in a
  multi-process learner (exactly one process publishes).
- `HFDirSink` ('hf_dir'): each version written as a Hugging Face checkpoint directory
  `weights_dir/v{version:08d}` (atomically; all but the newest `sampler.keep_weight_versions`
  deleted), then announced on the same stream with its path (`WeightPublisher.publish_dir`:
  the message carries the directory, no tensors); engines that load from disk (SGLang's
  `/update_weights_from_disk`) read it there.

The learner hands every sink the same thing (`{"layers/0/attn/q_proj": ndarray}`, the
version, and the policy version when lag injection ships older weights) and never knows
which sink it has: the sampler kind's entry in the backend table chooses. As with a bare
publisher, the learner announces a version to the RolloutQueue before publishing it.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, Protocol

import numpy as np

from pipelinerl_jax.models import load_config, write_hf_dir
from pipelinerl_jax.models.config import dtype_of
from pipelinerl_jax.transport.config import publisher_kwargs, weights_address
from pipelinerl_jax.transport.versioned_dir import gc_versions, write_versioned_dir
from pipelinerl_jax.transport.weights import WeightPublisher

SINK_KINDS = ("stream", "hf_dir")
Params = Mapping[str, np.ndarray]


class WeightSink(Protocol):
    def publish(self, version: int, params: Params,
                policy_version: Optional[int] = None) -> None:
        """Delivers `params` (flat host arrays, not modified afterwards) as `version`;
        `policy_version`: the policy they are, when not `version` (lag injection)."""

    def close(self) -> None:
        """Stops delivering (subscribers keep the last complete version)."""


class StreamSink:
    """The arrays themselves over the weight stream."""

    def __init__(self, publisher: WeightPublisher):
        self.publisher = publisher

    def publish(self, version: int, params: Params,
                policy_version: Optional[int] = None) -> None:
        self.publisher.publish(version, params, policy_version)

    def close(self) -> None:
        self.publisher.stop()


class NullSink:
    """A sink that delivers nothing (a multi-process learner's non-primary processes)."""

    def publish(self, version: int, params: Params,
                policy_version: Optional[int] = None) -> None:
        pass

    def close(self) -> None:
        pass


class HFDirSink:
    """An HF checkpoint directory per version under `root`, announced on the stream.

    `save_model(params, directory)` writes one directory (`hf_checkpoint_writer`).
    """

    def __init__(self, root: str, publisher: WeightPublisher,
                 save_model: Callable[[Params, str], None], keep_versions: int = 3):
        self.root, self.publisher, self.save_model = root, publisher, save_model
        self.keep_versions = keep_versions

    def publish(self, version: int, params: Params,
                policy_version: Optional[int] = None) -> None:
        # overwrite: a learner restarted from an older checkpoint writes versions again
        path = write_versioned_dir(self.root, version, lambda d: self.save_model(params, d),
                                   overwrite=True)
        gc_versions(self.root, self.keep_versions)
        self.publisher.publish_dir(version, os.path.abspath(path), policy_version)

    def close(self) -> None:
        self.publisher.stop()


def hf_checkpoint_writer(checkpoint: str, dtype="float32",
                         param_dtype=None) -> Callable[[Params, str], None]:
    """`save(params, directory)`: the HF directory of a model shaped like `checkpoint`'s
    (loaded with these dtypes, as the learner loads it) holding `params`, written by
    `models.write_hf_dir` (the one HF-directory writer; it checks names, shapes and dtypes).
    Only the config is read here; nothing goes to a device."""
    config = load_config(checkpoint, dtype=dtype_of(dtype),
                         param_dtype=None if param_dtype is None else dtype_of(param_dtype))

    def save(params: Params, directory: str) -> None:
        write_hf_dir(params, config, directory)

    return save


def peft_dir_writer(checkpoint: str, spec, dtype="float32",
                    param_dtype=None) -> Callable[[Params, str], None]:
    """`save(adapters, directory)` for LoRA runs (`spec`, a `models.lora.LoRASpec`): the
    adapter-only flat dict as a PEFT adapter directory (`models.peft_io.write_peft_dir`,
    checked against `checkpoint`'s config), what SGLang's `/load_lora_adapter` reads."""
    from pipelinerl_jax.models.peft_io import write_peft_dir
    config = load_config(checkpoint, dtype=dtype_of(dtype),
                         param_dtype=None if param_dtype is None else dtype_of(param_dtype))

    def save(adapters: Params, directory: str) -> None:
        write_peft_dir(adapters, config, spec, directory, base_model=os.path.abspath(checkpoint))

    return save


def weights_dir(cfg, workdir: str) -> str:
    """Where an 'hf_dir' sink writes versions: `sampler.weights_dir`, or `workdir/weights`."""
    return cfg.sampler.weights_dir or os.path.join(workdir, "weights")


def make_weight_sink(kind: str, cfg, workdir: str, *,
                     publisher: Optional[WeightPublisher] = None,
                     init_checkpoint: Optional[str] = None,
                     save_model: Optional[Callable[[Params, str], None]] = None) -> WeightSink:
    """The sink of `kind` ('stream' | 'hf_dir') for a run's learner. It owns `publisher`
    (default: one bound to `transport`'s weights address) and stops it on `close()`. An
    'hf_dir' sink saves with `save_model`, default `hf_checkpoint_writer(init_checkpoint,
    model.dtype, model.param_dtype)` (with `lora.enabled`: `peft_dir_writer`, a PEFT adapter
    directory per version)."""
    if kind not in SINK_KINDS:
        raise ValueError(f"weight sink kind: unknown {kind!r}; valid: {SINK_KINDS}")
    if kind == "hf_dir" and save_model is None:
        if init_checkpoint is None:
            raise ValueError("an 'hf_dir' weight sink needs save_model or init_checkpoint")
        from pipelinerl_jax.models.lora import lora_spec
        writer = hf_checkpoint_writer if lora_spec(cfg) is None else (
            lambda *a: peft_dir_writer(a[0], lora_spec(cfg), *a[1:]))
        save_model = writer(init_checkpoint, cfg.model.dtype, cfg.model.param_dtype)
    if publisher is None:
        publisher = WeightPublisher(weights_address(cfg.transport),
                                    **publisher_kwargs(cfg.transport))
    if kind == "stream":
        return StreamSink(publisher)
    return HFDirSink(weights_dir(cfg, workdir), publisher, save_model,
                     keep_versions=cfg.sampler.keep_weight_versions)
