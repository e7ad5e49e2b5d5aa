"""Test-wide setup: 8 fake CPU devices so sharding is tested for real on one host."""
import os

# Must be set before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compiled programs persist across test processes (and CI steps): see compile_cache.py.
from pipelinerl_jax import compile_cache  # noqa: E402

compile_cache.enable()
