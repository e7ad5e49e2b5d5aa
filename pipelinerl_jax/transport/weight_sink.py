"""Where the learner's weights go: one small interface, two ways of delivering them.

    sink = make_weight_sink(kind, cfg, workdir, init_checkpoint=path)    # the launcher
    sink.publish(version, params_flat, policy_version=None)               # the learner, per step
    sink.close()

- `StreamSink` ('stream'): the flat host arrays over the gRPC weight stream
  (`WeightPublisher`); embedded engines (JaxEngine) install them from memory.
- `NullSink`: delivers nothing; what every learner process but the first holds in a
  multi-process learner (exactly one process publishes).
- `HFDirSink` ('hf_dir'): each version written as a directory `weights_dir/v{version:08d}`
  by `write_weight_version` (atomically; all but the newest `sampler.keep_weight_versions`
  deleted), then announced on the same stream with its path (the message carries the
  directory, no tensors); engines that load from disk (SGLang) read it there.

Every sink holds the run's `WeightVersion` description (`weight_version.describe_run`: kind
'full' or 'lora', base sha256, LoRA shape) and sends each version as that message carrying
the arrays or the directory. The learner hands every sink the same thing (`{"layers/0/attn/
q_proj": ndarray}`, the version, and the policy version when lag injection ships older
weights) and never knows which sink it has: the sampler kind's entry in the backend table
chooses. As with a bare publisher, the learner announces a version to the RolloutQueue
before publishing it.

`write_weight_version(root, message, save)` is the one writer of versioned weight
directories (this sink, `SGLangEngine` given arrays, the evaluator's outbox): the tensors
written by `save` (`dir_writer`: an HF checkpoint for 'full', a PEFT adapter directory for
'lora'), the message's description beside them (`weight_version.json`), all appearing at
once (`versioned_dir.write_versioned_dir`); `read_weight_version(path)` reads it back.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Mapping, Optional, Protocol

import numpy as np

from pipelinerl_jax.models import load_config, write_hf_dir
from pipelinerl_jax.models.decoder_config import dtype_of
from pipelinerl_jax.models.peft_io import write_peft_dir
from pipelinerl_jax.transport.transport_section import publisher_kwargs, weights_address
from pipelinerl_jax.transport.versioned_dir import gc_versions, write_versioned_dir
from pipelinerl_jax.transport.weight_version import (DESCRIPTION_FILE, WeightVersion,
                                                     describe_run)
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


def write_weight_version(root: str, message: WeightVersion,
                         save: Callable[[Params, str], None]) -> WeightVersion:
    """`message`'s tensors as `root/v{version:08d}` (written by `save(tensors, directory)`,
    with `weight_version.json` beside them), atomically, replacing an older copy (a learner
    restarted from an older checkpoint writes versions again); returns `message` carrying
    the directory's absolute path instead of the tensors."""
    def write(directory: str) -> None:
        save(message.tensors, directory)
        with open(os.path.join(directory, DESCRIPTION_FILE), "w") as f:
            json.dump(message.to_json(), f)

    path = write_versioned_dir(root, message.version, write, overwrite=True)
    return message.carrying(message.version, path=os.path.abspath(path),
                            policy_version=message.policy_version)


def read_weight_version(path: str, describes: WeightVersion) -> WeightVersion:
    """The message a versioned directory holds (its `weight_version.json`; a directory
    without one, e.g. a plain HF checkpoint, is taken as `describes` says)."""
    try:
        with open(os.path.join(path, DESCRIPTION_FILE)) as f:
            return WeightVersion.from_json(json.load(f), os.path.abspath(path))
    except FileNotFoundError:
        return describes.carrying(describes.version, path=os.path.abspath(path))


def dir_writer(describes: WeightVersion, model_config,
               base_checkpoint: Optional[str] = None) -> Callable[[Params, str], None]:
    """`save(tensors, directory)` for the versions `describes` describes: an HF checkpoint of
    `model_config` ('full'), or a PEFT adapter directory ('lora', what SGLang's
    `/load_lora_adapter` reads; checked against `model_config`)."""
    if describes.kind == "lora":
        base = None if base_checkpoint is None else os.path.abspath(base_checkpoint)
        return lambda tensors, d: write_peft_dir(tensors, model_config, describes.lora, d,
                                                 base_model=base)
    return lambda tensors, d: write_hf_dir(tensors, model_config, d)


class StreamSink:
    """The arrays themselves over the weight stream."""

    def __init__(self, publisher: WeightPublisher,
                 describes: WeightVersion = WeightVersion("full")):
        self.publisher, self.describes = publisher, describes

    def publish(self, version: int, params: Params,
                policy_version: Optional[int] = None) -> None:
        self.publisher.publish(self.describes.carrying(version, tensors=params,
                                                       policy_version=policy_version))

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
    """A directory per version under `root` (`write_weight_version`), announced on the stream.

    `save_model(params, directory)` writes one directory (`dir_writer`,
    `hf_checkpoint_writer`); `describes`: what the versions are.
    """

    def __init__(self, root: str, publisher: WeightPublisher,
                 save_model: Callable[[Params, str], None], keep_versions: int = 3,
                 describes: WeightVersion = WeightVersion("full")):
        self.root, self.publisher, self.save_model = root, publisher, save_model
        self.keep_versions, self.describes = keep_versions, describes

    def publish(self, version: int, params: Params,
                policy_version: Optional[int] = None) -> None:
        message = write_weight_version(self.root, self.describes.carrying(
            version, tensors=params, policy_version=policy_version), self.save_model)
        gc_versions(self.root, self.keep_versions)
        self.publisher.publish(message)

    def close(self) -> None:
        self.publisher.stop()


def hf_checkpoint_writer(checkpoint: str, dtype="float32", param_dtype=None,
                         describes: WeightVersion = WeightVersion("full")
                         ) -> Callable[[Params, str], None]:
    """`dir_writer` for a model shaped like `checkpoint`'s (loaded with these dtypes, as the
    learner loads it): an HF directory holding full weights (`models.write_hf_dir` checks
    names, shapes and dtypes) or, for a 'lora' `describes`, a PEFT adapter directory. Only
    the config is read here; nothing goes to a device."""
    config = load_config(checkpoint, dtype=dtype_of(dtype),
                         param_dtype=None if param_dtype is None else dtype_of(param_dtype))
    return dir_writer(describes, config, checkpoint)


def weights_dir(cfg, workdir: str) -> str:
    """Where an 'hf_dir' sink writes versions: `sampler.weights_dir`, or `workdir/weights`."""
    return cfg.sampler.weights_dir or os.path.join(workdir, "weights")


def make_weight_sink(kind: str, cfg, workdir: str, *,
                     publisher: Optional[WeightPublisher] = None,
                     init_checkpoint: Optional[str] = None,
                     save_model: Optional[Callable[[Params, str], None]] = None,
                     describes: Optional[WeightVersion] = None) -> WeightSink:
    """The sink of `kind` ('stream' | 'hf_dir') for a run's learner, sending the messages
    `describes` describes (default: `weight_version.describe_run(cfg, init_checkpoint)`).
    It owns `publisher` (default: one bound to `transport`'s weights address) and stops it
    on `close()`. An 'hf_dir' sink saves with `save_model`, default
    `hf_checkpoint_writer(init_checkpoint, model.dtype, model.param_dtype, describes)` (an HF
    checkpoint, or for 'lora' a PEFT adapter directory, per version)."""
    if kind not in SINK_KINDS:
        raise ValueError(f"weight sink kind: unknown {kind!r}; valid: {SINK_KINDS}")
    if kind == "hf_dir" and save_model is None and init_checkpoint is None:
        raise ValueError("an 'hf_dir' weight sink needs save_model or init_checkpoint")
    if describes is None:
        describes = (WeightVersion("full") if init_checkpoint is None
                     else describe_run(cfg, init_checkpoint))
    if kind == "hf_dir" and save_model is None:
        save_model = hf_checkpoint_writer(init_checkpoint, cfg.model.dtype,
                                          cfg.model.param_dtype, describes)
    if publisher is None:
        publisher = WeightPublisher(weights_address(cfg.transport),
                                    **publisher_kwargs(cfg.transport))
    if kind == "stream":
        return StreamSink(publisher, describes)
    return HFDirSink(weights_dir(cfg, workdir), publisher, save_model,
                     keep_versions=cfg.sampler.keep_weight_versions, describes=describes)
