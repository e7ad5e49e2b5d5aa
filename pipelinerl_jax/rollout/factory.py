"""The engine backends, one table row per `sampler.kind`: which `InferenceEngine` a rollout
worker drives, the run-config section that configures it, and how the learner's weights
reach it.

    'jax'     the embedded `JaxEngine` (default), section `engine`; weights stream as flat
              arrays over gRPC;
    'sglang'  SGLang servers over HTTP, section `sglang`; the learner writes each version as
              an HF checkpoint directory (`sampler.weights_dir/v{version:08d}`) and the
              worker points the servers at it (`/update_weights_from_disk`).

`run_config` builds and validates every row's section from `BACKENDS`; the launcher calls
`make_engine`; the learner reads only `weight_sink`. A new backend is its own module (config
defaults, a check, an engine factory) plus one row here (docs/engine.md, "Adding a backend").
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from pipelinerl_jax.rollout import jax_engine, sglang_config, sglang_engine
from pipelinerl_jax.transport.weight_sink import SINK_KINDS

WEIGHT_SINKS = SINK_KINDS  # the sinks transport/weight_sink.py provides


@dataclasses.dataclass(frozen=True)
class Backend:
    """One engine backend.

    section: key of its run-config section; config: () -> that section's defaults;
    validate: (run config, selected) -> None, raises `ConfigError` naming the key (`selected`:
    this is `sampler.kind`, so checks that only matter when it samples apply);
    make_engine: (run config, init checkpoint, worker index, workdir) -> an engine at version
    -1; weight_sink: how the learner publishes versions: 'stream' (flat arrays over gRPC) or
    'hf_dir' (an HF directory per version, announced over gRPC).
    """
    section: str
    config: Callable
    validate: Callable
    make_engine: Callable
    weight_sink: str


BACKENDS = {
    "jax": Backend("engine", jax_engine.engine_config, jax_engine.validate_run_config,
                   jax_engine.make_jax_engine, "stream"),
    "sglang": Backend("sglang", sglang_config.sglang_config, sglang_config.validate_run_config,
                      sglang_engine.make_sglang_engine, "hf_dir"),
}
SAMPLER_KINDS = tuple(BACKENDS)


def backend(kind: str) -> Backend:
    """The table row of `sampler.kind` = `kind`."""
    if kind not in BACKENDS:
        raise ValueError(f"sampler.kind: unknown {kind!r}; valid: {tuple(BACKENDS)}")
    return BACKENDS[kind]


def make_engine(cfg, init_checkpoint: str, index: int, workdir: str):
    """The engine of rollout worker `index`, holding no usable weights yet (version -1)."""
    return backend(cfg.sampler.kind).make_engine(cfg, init_checkpoint, index, workdir)
