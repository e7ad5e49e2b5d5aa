"""The one rule for optional test dependencies (pytest.ini): a test module imports them through
`optional(name)`, which skips the module, naming what installs it, when one is missing; with
`CI=true` in the environment (.ci/run sets it) tests/conftest.py turns every skip into a
failure, so CI skips nothing. Only tests marked with one of `CI_MAY_SKIP` (they need another
Python with sglang-jax and an accelerator, or root for network namespaces) may skip there."""
import importlib
import os

import pytest

# What installs each optional test dependency (setup.py's extras).
OPTIONAL = {"torch": ".[dev]", "transformers": ".", "peft": ".[dev]",
            "tensorboardX": ".[dev]", "grpc_tools": ".[dev]"}
# markers whose tests need hardware, a Python or privileges (network namespaces) CI may lack
CI_MAY_SKIP = ("sglang_real", "netns")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def optional(name: str):
    """`import name` for a test module, or skip the module when it is missing (pytest.ini's
    rule for optional test dependencies; in CI the skip becomes a failure)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        where = OPTIONAL.get(name.split(".")[0], ".[dev]")
        pytest.skip(f"optional test dependency {name!r} is missing ({e}): "
                    f"pip install -e '{where}'", allow_module_level=True)
