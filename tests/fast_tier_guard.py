"""The fast tier's rule (pytest.ini): no test outside `slow` starts a process or sleeps on the
wall clock. Enforced, not hoped for: while a test that is not marked `slow` runs (its setup,
body and teardown, so a fixture it pulls in counts too; tests/conftest.py's hooks), starting a
process (subprocess, multiprocessing, os.fork/posix_spawn/system) fails it at once, and one
time.sleep longer than SLEEP_MAX_S, or sleeps (every thread) adding up to more than
SLEEP_TOTAL_S, fails it at the end. Move such a test to `slow`, or make it wait on an event
instead of the clock. tests/test_fast_tier_guard.py shows that the guard fails a test.

PIPELINERL_FAST_GUARD=report lists offenders in $PIPELINERL_FAST_GUARD_LOG (default
fast_guard.log) instead of failing them, to survey a tree at once.
"""
import os

SLEEP_MAX_S = 0.2     # one time.sleep call
SLEEP_TOTAL_S = 1.0   # all time.sleep calls of one test, every thread
GUARD_REPORT = os.environ.get("PIPELINERL_FAST_GUARD") == "report"  # list, don't fail


class FastTierViolation(AssertionError):
    pass


class _FastTierGuard:
    """Patches the ways a test could start a process or sleep; active only inside a fast-tier
    test's phases."""

    def __init__(self):
        import multiprocessing.process
        import subprocess
        import threading
        import time
        self.active = None  # the nodeid of the fast-tier test now running, or None
        self.problems: list[str] = []
        self.slept = 0.0
        self._lock = threading.Lock()
        guard = self
        real_sleep = time.sleep
        self.real_sleep = real_sleep

        def sleep(seconds):
            if guard.active is not None:
                with guard._lock:
                    guard.slept += max(0.0, float(seconds))
                    if seconds > SLEEP_MAX_S:
                        guard.problems.append(f"time.sleep({seconds:g}) on the wall clock "
                                              f"(limit {SLEEP_MAX_S} s per call)")
            return guard.real_sleep(seconds)
        time.sleep = sleep

        def refuse(what, real):
            def start(*args, **kwargs):
                if guard.active is not None:
                    msg = f"started a process ({what})"
                    guard.problems.append(msg)
                    if not GUARD_REPORT:
                        raise FastTierViolation(f"{guard.active}: a fast-tier test {msg}; "
                                                f"mark it slow (pytest.ini)")
                return real(*args, **kwargs)
            return start
        subprocess.Popen._execute_child = refuse("subprocess.Popen",
                                                 subprocess.Popen._execute_child)
        multiprocessing.process.BaseProcess.start = refuse(
            "multiprocessing", multiprocessing.process.BaseProcess.start)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                setattr(os, name, refuse(f"os.{name}", getattr(os, name)))

    def begin(self, item):
        if item.get_closest_marker("slow") is None:
            self.active = item.nodeid

    def end(self, final):
        """Stops watching; raises the problems seen so far, if any (the sleep total at the
        test's last phase)."""
        with self._lock:
            problems, slept, nodeid = self.problems, self.slept, self.active
            self.active = None
            self.problems = []
        if nodeid is None:
            return
        if final and slept > SLEEP_TOTAL_S:
            problems = problems + [f"time.sleep calls add up to {slept:.2f} s "
                                   f"(limit {SLEEP_TOTAL_S} s per test)"]
        if problems:
            if GUARD_REPORT:
                with open(os.environ.get("PIPELINERL_FAST_GUARD_LOG", "fast_guard.log"),
                          "a") as f:
                    f.write(f"{nodeid}\t{'; '.join(sorted(set(problems)))}\n")
                return
            raise FastTierViolation(f"a fast-tier test {'; '.join(sorted(set(problems)))}: "
                                    f"mark it slow, or wait on an event instead of the clock "
                                    f"(pytest.ini, tests/conftest.py)")

    def phase(self, item, final):
        self.begin(item)
        try:
            result = yield
        except BaseException:
            with self._lock:
                self.active, self.problems = None, []  # the phase failed already
            raise
        self.end(final)
        return result


GUARD = _FastTierGuard()
