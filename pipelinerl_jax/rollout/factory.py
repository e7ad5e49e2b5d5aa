"""Which `InferenceEngine` a rollout worker drives (`config.sampler.kind`).

    'jax'     the embedded `JaxEngine` (default): weights arrive as flat arrays over gRPC;
    'sglang'  SGLang servers over HTTP: the learner writes each version as an HF checkpoint
              directory (`sampler.weights_dir/v{version:08d}`) and the worker points the
              servers at it (`/update_weights_from_disk`).
The worker and learner never depend on which one they have.
"""
from __future__ import annotations

from pipelinerl_jax.transport.weight_sink import weights_dir  # noqa: F401 (re-export)

SAMPLER_KINDS = ("jax", "sglang")


def make_engine(cfg, init_checkpoint: str, index: int, workdir: str):
    """The engine of rollout worker `index`, holding no usable weights yet (version -1)."""
    if cfg.sampler.kind == "jax":
        from pipelinerl_jax.models import from_pretrained
        from pipelinerl_jax.rollout.jax_engine import JaxEngine
        model = from_pretrained(init_checkpoint, dtype=cfg.engine.dtype)
        return JaxEngine(model, cfg.engine, version=-1, engine_id=f"jax-{index}", start=True)
    if cfg.sampler.kind == "sglang":
        from pipelinerl_jax.rollout.sglang_engine import make_sglang_engine
        return make_sglang_engine(cfg, index, workdir)
    raise ValueError(f"sampler.kind: unknown {cfg.sampler.kind!r}; valid: {SAMPLER_KINDS}")
