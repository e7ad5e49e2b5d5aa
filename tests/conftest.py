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

# Compiled programs persist across test processes (and CI steps): see compile_cache.py. The
# suite compiles hundreds of small programs (0.02-0.5 s each) that a run's default threshold
# (0.5 s) leaves out; cached, the fast tier took 2:55 instead of 3:31 (warm, `-n 2`). Set in
# the environment, so the processes the slow tests start read it too.
os.environ.setdefault("PIPELINERL_JAX_CACHE_MIN_SECS", "0.02")
from pipelinerl_jax import compile_cache  # noqa: E402

compile_cache.enable()

from tests.optional_deps import CI_MAY_SKIP, in_ci  # noqa: E402

def _ci_skip_failure(report, why: str):
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI (CI=true: nothing may be skipped, pytest.ini): {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") \
            and not any(item.get_closest_marker(m) for m in CI_MAY_SKIP):
        _ci_skip_failure(report, str(report.longrepr))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:
        _ci_skip_failure(report, str(report.longrepr))


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


@pytest.fixture(scope="session")
def device_check_cpu(tmp_path_factory):
    """`scripts/device_check.sh --cpu`, run once per session: (exit status, the JSON result,
    `part_json(part)` = the last JSON line of a part's log, i.e. its benchmark script's own
    output). The benchmark smoke tests read their scripts' output from here instead of running
    each script a second time (bench_lora, bench_real_size's learner and engine halves)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    env.pop("OUT", None)
    base = tmp_path_factory.mktemp("device_check")
    out, work = base / "out", base / "work"
    proc = subprocess.run(["bash", os.path.join(root, "scripts", "device_check.sh"), "--cpu",
                           f"--out={out}", f"--workdir={work}"], capture_output=True,
                          text=True, env=env, cwd=root, timeout=1500)
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    def part_json(part):
        for line in reversed((out / f"{part}.log").read_text().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
        raise AssertionError(f"no JSON line in {part}.log: {(out / f'{part}.log').read_text()[-2000:]}")
    return proc.returncode, result, out, part_json


# The fast tier's rule, enforced (tests/fast_tier_guard.py): outside `slow`, a test that starts
# a process or sleeps on the wall clock fails.
from tests.fast_tier_guard import GUARD as _GUARD  # noqa: E402


def pytest_sessionstart(session):
    # A run reads its provenance (git's sha: a process) once, at start; so does the test
    # session, before any test, so the fast tier's tests that record provenance start none.
    from pipelinerl_jax import provenance
    provenance.provenance()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _GUARD.slept = 0.0
    return (yield from _GUARD.phase(item, final=False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _GUARD.phase(item, final=False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _GUARD.phase(item, final=True))
