"""The TPU compiler for the ahead-of-time tests: libtpu (the `tpu` extra) compiles for a TPU
topology on this CPU host. In CI (`CI` set) a missing libtpu fails these tests, never skips
them: CI installs `.[dev,tpu]`, so a missing compiler there is a broken install."""
import os

import pytest


@pytest.fixture(scope="session")
def v5e_2x2():
    """(devices, chip) of the `v5e:2x2` topology (4 abstract TPU v5e chips)."""
    from pipelinerl_jax.aot import chips
    try:
        return chips.topology("v5e:2x2")
    except chips.TopologyError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the TPU compiler is missing in CI: {e}", pytrace=False)
        pytest.skip(f"no TPU compiler here (pip install -e '.[tpu]'): {e}")
