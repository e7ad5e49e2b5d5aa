"""The fast tier's guard (tests/fast_tier_guard.py) can fail a test: inside this fast-tier
test, starting a process is refused at once, and a long sleep or too much sleeping is what
the guard reports when the test ends (checked here on the guard itself, then cleared)."""
import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.fast_tier_guard import GUARD, SLEEP_MAX_S, SLEEP_TOTAL_S, FastTierViolation


def test_the_guard_is_watching_this_fast_tier_test(request):
    assert GUARD.active == request.node.nodeid


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"]),
    lambda: subprocess.Popen(["true"]),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: os.system("true"),
], ids=["subprocess.run", "Popen", "multiprocessing", "os.system"])
def test_starting_a_process_fails_the_test(start, request):
    with pytest.raises(FastTierViolation, match="started a process"):
        start()
    with pytest.raises(FastTierViolation, match="started a process"):
        GUARD.end(final=False)  # what the hook raises when a test swallowed the error
    GUARD.begin(request.node)  # watching again for the rest of this test


def test_a_long_sleep_or_many_short_ones_fail_the_test(request, monkeypatch):
    import time
    monkeypatch.setattr(GUARD, "real_sleep", lambda s: None)  # counted, not slept
    time.sleep(SLEEP_MAX_S + 0.01)
    with pytest.raises(FastTierViolation, match=r"time\.sleep\(0\.21\) on the wall clock"):
        GUARD.end(final=False)
    GUARD.begin(request.node)
    GUARD.slept = 0.0
    for _ in range(int(SLEEP_TOTAL_S / 0.1) + 1):
        time.sleep(0.1)
    with pytest.raises(FastTierViolation, match=r"add up to 1\.10 s"):
        GUARD.end(final=True)
    GUARD.begin(request.node)
    GUARD.slept = 0.0  # this test's own sleeps are spent; the hooks find it clean


@pytest.mark.slow
def test_a_slow_test_may_start_a_process_and_sleep():
    assert GUARD.active is None
    assert subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"]).returncode == 0
