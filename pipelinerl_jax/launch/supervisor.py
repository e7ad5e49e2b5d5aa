"""The process supervisor: child processes with their own logs, restarts and an ordered stop.

One supervisor serves the launcher (queue, learner, workers, the warm start) and the ablation
runner (one launcher per run). A child

* runs in a new session, so a Ctrl-C in the terminal reaches the supervising process only,
  which then stops its children in order;
* appends its stdout and stderr to its own log file;
* is restarted after it dies, up to a limit (`restart`); past that, `LaunchError` carries the
  tail of its log;
* leaves a line in an `events.jsonl` per start, exit and stop (time, child, pid, exit code;
  a stop also its seconds and whether it had to be killed) when given one;
* is stopped with SIGTERM (roles stop cleanly on it: the learner checkpoints, a launcher
  stops its own children) and killed, with its process group, after a grace period.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, List, Optional


class LaunchError(RuntimeError):
    pass


def record_event(path: str, event: str, **fields) -> None:
    """Appends `{"time_s", "event", **fields}` to the JSONL file `path` (e.g. events.jsonl)."""
    with open(path, "a") as f:
        f.write(json.dumps({"time_s": time.time(), "event": event, **fields}) + "\n")


def tail(path: str, n: int = 40) -> str:
    """The last `n` lines of a log file (for error messages)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class Child:
    """One child process: `cmd` with its output appended to `log_path`.

    `events`: the events.jsonl to record starts and exits in (None: none). `stop_rank`: the
    order in which `stop_all` stops children (lower first)."""

    def __init__(self, name: str, cmd: List[str], log_path: str, *, env: Optional[dict] = None,
                 events: Optional[str] = None, stop_rank: int = 0):
        self.name, self.cmd, self.log_path = name, list(cmd), log_path
        self.env, self.events, self.stop_rank = env, events, stop_rank
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self.started_at = 0.0

    def start(self) -> "Child":
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env=dict(os.environ) if self.env is None else self.env)
        self.started_at = time.time()
        if self.events:
            record_event(self.events, "start", child=self.name, pid=self.proc.pid,
                         restarts=self.restarts)
        return self

    def exited(self, code: int) -> None:
        """Records that the child exited with `code` (in `events`)."""
        if self.events:
            record_event(self.events, "exit", child=self.name, code=code, restarts=self.restarts)

    def restart(self, code: int, limit: int) -> None:
        """Starts the child again after it exited with `code`; LaunchError past `limit`."""
        self.exited(code)
        if self.restarts >= limit:
            raise LaunchError(f"{self.name} exited with {code} and was restarted "
                              f"{self.restarts} times already (limit {limit}):\n"
                              f"{tail(self.log_path)}")
        self.restarts += 1
        with open(self.log_path, "a") as f:
            f.write(f"\n[launcher] {self.name} exited with {code}; restart {self.restarts}\n")
        self.start()

    def poll(self, timeout: float = 0.0) -> Optional[int]:
        """The exit code, or None while it runs; waits up to `timeout` s for it to exit
        (returning as soon as it does)."""
        if self.proc is None:
            return None
        if timeout <= 0:
            return self.proc.poll()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL to its process group after `timeout` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        t0, killed = time.time(), False
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it exited meanwhile
            self.proc.wait()
        if self.events:
            record_event(self.events, "stop", child=self.name, pid=self.proc.pid,
                         code=self.proc.returncode, seconds=round(time.time() - t0, 3),
                         killed=killed)

    def wait(self, timeout_s: Optional[float] = None, *, grace: float = 60.0,
             every: Optional[Callable[[], None]] = None, interval: float = 1.0) -> int:
        """Waits for the started child to exit and returns its exit code; -1 when it ran past
        `timeout_s` (it is then stopped). `every()` is called each `interval` seconds (a
        progress bar, a stop request); an exception from it, or Ctrl-C, stops the child
        (with `grace` seconds to exit) and goes on."""
        try:
            while True:
                try:
                    return self.proc.wait(interval)
                except subprocess.TimeoutExpired:
                    pass
                if timeout_s is not None and time.time() - self.started_at > timeout_s:
                    self.stop(grace)
                    return -1
                if every is not None:
                    every()
        except BaseException:
            self.stop(grace)
            raise


def exit_now(code: int) -> None:
    """Ends a process whose work is done, as the interpreter would but without finalizing.

    Python's exit joins the non-daemon threads (`threading._shutdown`, which first wakes
    idle executor workers), runs the atexit handlers, then finalizes: frees every module,
    which tears down the native libraries' thread pools (gRPC's timer, LLVM's and XLA's
    workers), each waking on its own ~1 s tick. On the quick config that last part took
    2.7 s of the learner's exit and 1 s of a worker's, on the run's critical path (the
    launcher stops the workers once the learner has exited). It frees nothing the OS does
    not, so it is skipped; a role closes and flushes what it owns before it returns."""
    threading._shutdown()  # noqa: SLF001 - the interpreter's own first exit step
    atexit._run_exitfuncs()  # noqa: SLF001 - and its second
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_any(children: Iterable[Child], timeout: float, tick: float = 0.05) -> None:
    """Returns once any of `children` has exited, or after `timeout` seconds."""
    children = list(children)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(c.poll() is not None for c in children):
            return
        time.sleep(min(tick, max(0.0, deadline - time.time())))


def stop_all(children: Iterable[Child], timeout: float) -> None:
    """Stops every child, lowest `stop_rank` first (producers before their consumers)."""
    for c in sorted(children, key=lambda c: c.stop_rank):
        c.stop(timeout)
