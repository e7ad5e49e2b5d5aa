"""Test-wide setup: 8 fake CPU devices so sharding is tested for real on one host.

The device count is forced, not defaulted: an `XLA_FLAGS` already in the environment keeps its
other flags but gets `--xla_force_host_platform_device_count=8`, so the sharding tests can
never skip (or pass on one device) because of a caller's environment. Tests that need the 8
devices take the `eight_devices` fixture, which fails, naming the flag, when JAX has fewer.
"""
import os
import re

import pytest

DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"

# Must be set before jax is imported anywhere in the test process.
_flags = re.sub(rf"{_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f"{_FLAG}={DEVICES}"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compiled programs persist across test processes (and CI steps): see compile_cache.py.
from pipelinerl_jax import compile_cache  # noqa: E402

compile_cache.enable()


@pytest.fixture
def eight_devices():
    """The 8 devices the sharding tests run on; fails (never skips) when JAX has fewer."""
    import jax
    devices = jax.devices()
    if len(devices) < DEVICES:
        pytest.fail(f"needs {DEVICES} devices, JAX has {len(devices)} "
                    f"({devices[0].platform}); tests/conftest.py sets {_FLAG}={DEVICES} in "
                    f"XLA_FLAGS (now {os.environ.get('XLA_FLAGS')!r}), which JAX reads only if "
                    f"it was not imported before conftest", pytrace=False)
    return devices[:DEVICES]
