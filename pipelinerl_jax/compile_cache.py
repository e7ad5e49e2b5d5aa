"""JAX's persistent compilation cache, shared by every process of every run.

A run starts several processes that compile the same programs (the learner's train step per
row bucket, the engine's prefill/decode buckets, the evaluator); a re-run, a resumed run, an
ablation grid or the test suite compile them again. With the cache, only the first process
pays: measured here, the default train step compiles in ~10 s cold and loads in ~1.8 s.
Entries are keyed by the program's HLO, compile options and jax/XLA version, so a code or
version change can never reuse a stale executable.

    PIPELINERL_JAX_CACHE=/path   cache directory (default ~/.cache/pipelinerl_jax/xla)
    PIPELINERL_JAX_CACHE=off     disable
    PIPELINERL_JAX_CACHE_MIN_SECS=0.02   cache programs that took at least this long to
                                 compile (default 0.5: a run's few big programs; the test
                                 suite sets 0.02, its many small ones: the fast tier 3:31 ->
                                 2:55 warm on the 2-core VM)
"""
from __future__ import annotations

import os

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pipelinerl_jax", "xla")


def enable(directory: str | None = None) -> str | None:
    """Turns the cache on (before the first compilation); returns the directory or None."""
    directory = directory or os.environ.get("PIPELINERL_JAX_CACHE") or DEFAULT_DIR
    if directory.lower() in ("off", "0", "none", "false"):
        return None
    import jax  # late: callers pin cores before JAX loads
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return None  # an unwritable home must not stop a run; it only costs compile time
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _min_secs())
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def _min_secs() -> float:
    raw = os.environ.get("PIPELINERL_JAX_CACHE_MIN_SECS", "0.5")
    try:
        secs = float(raw)
    except ValueError:
        secs = -1.0
    if not secs >= 0:
        raise ValueError(f"PIPELINERL_JAX_CACHE_MIN_SECS={raw!r}: seconds, a number >= 0")
    return secs
