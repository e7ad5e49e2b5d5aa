"""The learner's processes on this host, supervised as one unit.

`launch.learner_processes=P` starts P learner processes that join one `jax.distributed`
group (learner/multihost.py): the launcher picks a free loopback port for the coordinator
and gives process i the standard variables

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT  JAX_NUM_PROCESSES=P  JAX_PROCESS_ID=i

and, for CPU devices, `--xla_force_host_platform_device_count=prod(mesh.shape)/P` in its
`XLA_FLAGS` (its share of the mesh; the flag only affects the CPU platform). Their logs are
`logs/learner{i}.log`; one process keeps the plain `learner` name. The run's SFT warm start,
one process on the same mesh, gets the whole mesh's CPU device count (`warm_start_env`).

A group is never left half running: the collectives of the survivors would wait for the dead
process forever. When any process exits with an error, the others are stopped (killed after a
short grace: a process blocked in a collective does not see SIGTERM) and the whole group is
restarted, on a new coordinator port, up to `launch.max_learner_restarts` times; the restarted
group resumes from the last committed checkpoint. The group is done when every process
exited 0.
"""
from __future__ import annotations

import math
import os
import signal
import socket
import time
from typing import List, Optional, Sequence

from pipelinerl_jax.launch import roles
from pipelinerl_jax.launch.supervisor import Child, LaunchError, record_event, tail

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_cpu_devices(base: dict, n: int) -> dict:
    """`base` with `n` CPU devices in its XLA_FLAGS (replacing any device count there)."""
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={n}"])
    return env


def process_env(base: dict, index: int, count: int, coordinator: str,
                cpu_devices: int) -> dict:
    """The environment of learner process `index` of `count` (see the module docstring)."""
    env = with_cpu_devices(base, cpu_devices)
    env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(count),
               JAX_PROCESS_ID=str(index))
    return env


def warm_start_env(cfg, base: Optional[dict] = None) -> Optional[dict]:
    """The warm start's environment in a run with a multi-process learner: one SFT process
    on the whole mesh, so every CPU device of the mesh (None: unchanged, one process)."""
    if int(cfg.launch.get("learner_processes", 1)) <= 1:
        return base
    return with_cpu_devices(dict(os.environ if base is None else base),
                            math.prod(tuple(cfg.mesh.shape)))


class LearnerGroup:
    """`launch.learner_processes` learner children, started, polled, restarted and stopped
    together; it stands where a single learner `Child` would (same methods)."""

    def __init__(self, cfg, workdir: str, env: Optional[dict] = None):
        self.count = int(cfg.launch.get("learner_processes", 1))
        self.cpu_devices = math.prod(tuple(cfg.mesh.shape)) // self.count
        self.grace_s = min(float(cfg.launch.shutdown_timeout_s), 10.0)
        self.base_env = env
        self.events = os.path.join(workdir, "events.jsonl")
        self.children: List[Child] = [
            roles.child("learner", workdir, i, env=env,
                        name="learner" if self.count == 1 else f"learner{i}")
            for i in range(self.count)]
        self.stop_rank = self.children[0].stop_rank
        self.name = "learner"
        self.restarts = 0
        self._failed: Optional[Child] = None  # the process whose exit took the group down

    def start(self) -> "LearnerGroup":
        if self.count > 1:
            coordinator = f"127.0.0.1:{free_port()}"  # a new port per start: no TIME_WAIT
            base = dict(os.environ if self.base_env is None else self.base_env)
            for i, c in enumerate(self.children):
                c.env = process_env(base, i, self.count, coordinator, self.cpu_devices)
        for c in self.children:
            c.restarts = self.restarts
            c.start()
        return self

    def poll(self, timeout: float = 0.0) -> Optional[int]:
        """None while running; 0 once every process exited 0; else the first failure's exit
        code, after the other processes were stopped. Waits up to `timeout` s for a process
        to exit (returning as soon as one does, like `Child.poll`)."""
        deadline = time.time() + timeout
        while True:
            codes = [c.poll() for c in self.children]
            if time.time() >= deadline or any(code is not None for code in codes):
                break
            self.children[0].poll(min(0.05, max(0.0, deadline - time.time())))
        if all(code == 0 for code in codes):
            return 0
        dead = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if not dead:
            return None
        # A process killed by a signal is the cause; the others' errors are mostly its effect
        # (a collective whose peer vanished), and may be seen at the same poll.
        dead.sort(key=lambda i: (codes[i] >= 0, i))
        failed = dead[0]
        self._failed = self.children[failed]
        record_event(self.events, "exit", child=self._failed.name, code=codes[failed],
                     restarts=self.restarts)
        for i in dead[1:]:
            record_event(self.events, "exit", child=self.children[i].name, code=codes[i],
                         restarts=self.restarts, reason="group member failed")
        self._stop(self.grace_s, exclude=[self.children[i] for i in dead])
        return codes[failed]

    def exited(self, code: int) -> None:
        """Records the group's clean exit (`code` 0 from `poll`): one event per process;
        a failed exit was recorded by `poll` already."""
        for c in self.children:
            c.exited(c.poll() if c.poll() is not None else code)

    def restart(self, code: int, limit: int) -> None:
        """Starts the whole group again after a process exited with `code` (poll's); past
        `limit` restarts, LaunchError with the tail of that process's log."""
        dead = self._failed or self.children[0]
        if self.restarts >= limit:
            raise LaunchError(f"{dead.name} exited with {code} and was restarted "
                              f"{self.restarts} times already (limit {limit}):\n"
                              f"{tail(dead.log_path)}")
        self.restarts += 1
        for c in self.children:
            with open(c.log_path, "a") as f:
                f.write(f"\n[launcher] {dead.name} exited with {code}; restarting the learner "
                        f"group (restart {self.restarts})\n")
        self.start()

    def stop(self, timeout: float) -> None:
        """SIGTERM to every process (any one's stop request stops them all, after their
        checkpoint), then SIGKILL to whatever runs past `timeout`."""
        self._stop(timeout)

    def _stop(self, timeout: float, exclude: Sequence[Child] = ()) -> None:
        live = [c for c in self.children if c not in exclude and c.poll() is None]
        for c in live:
            try:
                c.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        for c in live:
            c.stop(timeout)
            if exclude:
                record_event(self.events, "exit", child=c.name, code=c.poll(),
                             restarts=self.restarts, reason="group member failed")
