"""The servers behind `SGLangEngine`: least-loaded routing, health, removal and readmission,
and weight refits.

Routing. A server takes at most `sglang.concurrency_per_server` samples at once; each job goes
to the healthy server with the fewest samples in flight relative to its capacity.

Health. Startup waits up to `health_deadline_s` for `/health`. A server that stays
unreachable is removed from routing (its requests go to the others) and reported in
`health()` / `stats()`; a monitor re-probes it and, once it answers, refits it to the current
version (or to the one published while no server was up) before routing to it again.

Refit. `update_weights(path, version)` runs on all servers concurrently:
`/pause_generation {mode}` → `/update_weights_from_disk {model_path, weight_version:
str(version), flush_cache}` → `/continue_generation`, timed per server (`stats()['servers']`).
Updates are coalesced: while one refit runs, only the newest pending version is applied next.
`/update_weight_version` is never called (it aborts every request unless told not to). After
a failed load SGLang keeps serving its previous weights: the server stays in routing and the
failure is reported (`health()['refit_errors']`).

`ServerFleet` is a mixin of `SGLangEngine` and works on the state its `__init__` sets up
(`_servers`, `_cv`, `_stop`, `_paused`, `_version`, `_newest`, `_path`, `_deferred`,
`_refit_*`, in-flight counters).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, List, Optional

import numpy as np

from pipelinerl_jax.rollout.engine import EngineClosedError
from pipelinerl_jax.rollout.sglang_client import HTTPError, ServerClient, ServerUnavailable
from pipelinerl_jax.rollout.sglang_weights import write_hf_version

log = logging.getLogger(__name__)


class Server:
    """One SGLang server: its client, routing state, installed version and counters."""

    def __init__(self, client: ServerClient, capacity: int):
        self.client, self.url, self.capacity = client, client.url, capacity
        self.up = False
        self.reason: Optional[str] = "not checked yet"  # why it is out of routing
        self.in_flight = 0  # samples
        self.jobs: set = set()
        self.version: Optional[int] = None  # last version installed here
        self.refits, self.refit_s_total, self.last_refit_s = 0, 0.0, None
        self.refit_error: Optional[str] = None  # the last failed load, until one succeeds
        self.counts: collections.Counter = collections.Counter()


class ServerFleet:
    """Routing, health and refits of `SGLangEngine`'s servers (module docstring)."""

    # ------------------------------------------------------------------ routing

    def _pick_server(self) -> Optional[Server]:  # holds _cv
        ready = [s for s in self._servers if s.up and s.in_flight < s.capacity]
        return min(ready, key=lambda s: s.in_flight / s.capacity) if ready else None

    def _change_in_flight(self, s: Server, delta: int) -> None:  # holds _cv
        now = time.perf_counter()
        for c in (self._counters, self._window):
            c["slot_s"] += self._in_flight * (now - self._last_change)
            c["busy_s"] += (now - self._last_change) if self._in_flight else 0.0
        self._last_change = now
        self._in_flight += delta
        s.in_flight += delta

    # ------------------------------------------------------------------ startup / health

    def _wait_ready(self, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s

        def wait(s: Server):
            while not self._stop.is_set():
                if s.client.healthy(timeout=min(5.0, deadline_s)):
                    s.up, s.reason = True, None
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    s.reason = f"no healthy /health within {deadline_s}s"
                    return
                time.sleep(min(0.2, left))

        threads = [threading.Thread(target=wait, args=(s,), daemon=True) for s in self._servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not any(s.up for s in self._servers):
            raise TimeoutError(f"no SGLang server answered /health within {deadline_s}s "
                               f"(sglang.health_deadline_s): {list(self.config.urls)}")
        for s in self._servers:
            if not s.up:
                log.warning("SGLang server %s is not ready (%s); routing around it", s.url,
                            s.reason)

    def _model_info(self, s: Server) -> Any:
        try:
            return (s.client.get("/get_model_info", timeout=self.config.control_timeout_s)
                    or {}).get("weight_version")
        except (HTTPError, ServerUnavailable):
            return None

    def _mark_down(self, s: Server, reason: str) -> None:
        with self._cv:
            if s.up:
                log.warning("SGLang server %s removed from routing: %s", s.url, reason)
                s.counts["removed"] += 1
            s.up, s.reason = False, reason
            self._cv.notify_all()

    def _monitor_loop(self) -> None:
        """Re-admits removed servers that answer /health again, after refitting them to the
        live version (always: a server that comes back may have been restarted)."""
        while not self._stop.wait(self.config.health_check_interval_s):
            for s in [s for s in self._servers if not s.up]:
                if self._stop.is_set() or not s.client.healthy(timeout=5.0):
                    continue
                with self._cv:
                    path, version = self._deferred or (self._path, self._version)
                if path is not None:  # it may have restarted from its launch checkpoint
                    ok, msg = self._refit_server(s, path, version)
                    if not ok:
                        s.reason = f"answers /health but cannot be refit: {msg}"
                        continue
                with self._cv:
                    if self._deferred == (path, version):  # the version missed while down
                        self._version, self._path, self._deferred = version, path, None
                        self._counters["refits"] += 1
                        self._counters["deferred_refits"] += 1
                    if self._version != version:  # a newer one went live meanwhile: again
                        continue
                    s.up, s.reason = True, None
                    s.counts["readmitted"] += 1
                    self._cv.notify_all()
                log.warning("SGLang server %s is back in routing", s.url)

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights: Any, version: int, *, wait: bool = True,
                       timeout: Optional[float] = None, allow_older: bool = False) -> None:
        """Refits every server to `weights` (an HF directory, or arrays written to
        `weights_dir/v{version:08d}` first). See `InferenceEngine.update_weights`;
        `allow_older` permits going back to an older version (lag injection)."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"update_weights: version must be an integer, got {version!r}")
        version = int(version)
        with self._cv:
            self._check_newer(version, allow_older)
        path = self._weights_path(weights, version)
        with self._cv:
            self._check_newer(version, allow_older)
            self._refit_seq += 1
            seq = self._refit_seq
            self._refit_target = (seq, path, version)
            self._newest = max(self._newest, version) if not allow_older else version
            self._cv.notify_all()
            if not wait:
                return
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._refit_done < seq and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"update_weights: version {version} not live after "
                                       f"{timeout}s (engine at {self._version})")
                self._cv.wait(left)
            if seq in self._refit_error:
                raise RuntimeError(self._refit_error.pop(seq))
            if self._refit_done < seq:
                raise EngineClosedError(f"engine closed before version {version} went live")

    def _check_newer(self, version: int, allow_older: bool) -> None:  # holds _cv
        self._check_open()
        if not allow_older and version <= self._newest:
            raise ValueError(
                f"update_weights: version {version} is not newer than the engine's version "
                f"{self._newest} (live {self._version}); versions must strictly increase, a "
                "stale or duplicate update is never applied")

    def _weights_path(self, weights: Any, version: int) -> str:
        if isinstance(weights, (str, os.PathLike)):
            # Read by the servers, on their hosts: a shared file system, same path everywhere.
            return os.path.abspath(os.fspath(weights))
        if not self.weights_dir or self.model_config is None:
            raise ValueError("update_weights: arrays need SGLangEngine(weights_dir=..., "
                             "model_config=...) to be written as an HF directory; pass a "
                             "checkpoint directory instead")
        return write_hf_version(weights, self.model_config, self.weights_dir, version)

    def _refit_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop.is_set() and self._refit_target is None:
                    self._cv.wait()
                if self._stop.is_set():
                    return
                (seq, path, version), self._refit_target = self._refit_target, None
                servers = [s for s in self._servers if s.up]
            results = self._refit_all(servers, path, version)
            ok = [s for s, (good, _) in zip(servers, results) if good]
            with self._cv:
                if ok:
                    self._version, self._path = version, path
                    self._counters["refits"] += 1
                    if self._deferred is not None and self._deferred[1] <= version:
                        self._deferred = None
                elif self._refit_target is not None and not os.path.isdir(path):
                    # The learner garbage-collected it under a newer version: apply that one.
                    self._counters["refits_superseded"] += 1
                else:
                    if not servers:
                        self._deferred = (path, version)  # installed when a server is back
                    msgs = "; ".join(f"{s.url}: {m}" for s, (_, m) in zip(servers, results))
                    self._refit_error[seq] = (f"update_weights: version {version} could not be "
                                              f"installed on any server ({msgs or 'none up'})")
                    self._counters["refit_failures"] += 1
                    log.error(self._refit_error[seq])
                self._refit_done = seq
                self._cv.notify_all()

    def _refit_all(self, servers, path, version) -> list:
        """`_refit_server` on every server at once; [(ok, message)] in server order."""
        results: List[Any] = [None] * len(servers)

        def one(i, s):
            results[i] = self._refit_server(s, path, version)
        threads = [threading.Thread(target=one, args=(i, s), daemon=True)
                   for i, s in enumerate(servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def _refit_server(self, s: Server, path: str, version: int):
        """pause → update_weights_from_disk → continue on one server; (ok, message)."""
        mode = self.config.pause_mode
        timeout = self.config.control_timeout_s
        t0 = time.perf_counter()
        try:
            s.client.post("/pause_generation", {"mode": mode}, timeout=timeout)
            try:
                answer = s.client.post("/update_weights_from_disk", {
                    "model_path": path, "weight_version": str(version),
                    "flush_cache": mode != "in_place", "abort_all_requests": False},
                    timeout=timeout) or {}
                if answer.get("success") is False:
                    raise HTTPError(s.url, "/update_weights_from_disk", 200,
                                    str(answer.get("message")))
            finally:
                with self._cv:
                    keep_paused = self._paused
                if not keep_paused:
                    s.client.post("/continue_generation", {}, timeout=timeout)
        except HTTPError as e:
            # SGLang keeps serving its previous weights after a failed load: the server stays
            # in routing (its tokens carry their true version) and the failure is reported.
            msg = f"refit to version {version} failed: {e.message}"
            log.warning("SGLang server %s: %s", s.url, msg)
            with self._cv:
                s.refit_error = msg
            return False, msg
        except ServerUnavailable as e:
            self._mark_down(s, str(e))
            return False, str(e)
        dt = time.perf_counter() - t0
        with self._cv:
            s.version = version
            s.refits += 1
            s.refit_s_total += dt
            s.last_refit_s = dt
            s.refit_error = None
        return True, ""
