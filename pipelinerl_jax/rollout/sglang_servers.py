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

LoRA (`lora=True`, docs/lora.md): a version is a PEFT adapter directory. Installing it on a
server is `/load_lora_adapter {lora_name: 'v<version>.<k>', lora_path}` (no pause: SGLang
serves several adapters at once, `--max-loras-per-batch`); every job sent afterwards names it
(`lora_path` in /generate), and a request keeps the adapter it was admitted with to its end
(`lora_registry.acquire`), so each token's version is its job's. An adapter that is no longer
the server's newest is unloaded (`/unload_lora_adapter`) once none of our jobs on that
server names it (SGLang's unload would otherwise wait for them: `wait_for_unload`). Names are
never reused (`k` counts loads), so a reloaded version (lag injection, a server that came
back) cannot collide with one still loaded.

`SGLangEngine` owns one `ServerFleet` and uses it through its public methods. The fleet
owns the servers' state: routing and in-flight accounting, health, the paused flag, and the
weights (live, newest accepted, the refit in progress and the one deferred while no server
was up) with the refit and monitor threads. It shares two things with its engine, handed to
it explicitly: the engine's condition variable (a dispatcher waits on it for a free server
as well as for queued work) and the engine's stop event (set once the engine closes).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pipelinerl_jax.rollout.engine import EngineClosedError, check_version_order
from pipelinerl_jax.rollout.engine_stats import StatsWindow
from pipelinerl_jax.rollout.sglang_client import HTTPError, ServerClient, ServerUnavailable
from pipelinerl_jax.rollout.sglang_protocol import version_of

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
        self.adapter: Optional[str] = None  # LoRA: the adapter new jobs name
        self.adapters: set = set()  # LoRA: every adapter we loaded here and not unloaded


class ServerFleet:
    """Routing, health and refits of `SGLangEngine`'s servers (module docstring).

    `servers`: the `Server`s; `config`: the engine's `sglang` section; `cv`: the engine's
    condition variable (every method marked "holds cv" is called with it held); `stop`: the
    engine's stop event; `name`: for errors and thread names.
    """

    def __init__(self, servers: Sequence[Server], config, cv: threading.Condition,
                 stop: threading.Event, name: str, lora: bool = False):
        self.servers = list(servers)
        self.config, self.name = config, name
        self.lora = lora  # versions are LoRA adapter directories (module docstring)
        self._adapter_seq = 0
        self._cv, self._stop = cv, stop
        self._paused = False
        self._occupancy = StatsWindow()  # samples in flight over time: slot_s, busy_s
        self._counts: collections.Counter = collections.Counter()
        # weights: newest accepted, live, and the refit in progress / pending
        self._version = -1
        self._newest = -1
        self._path: Optional[str] = None  # directory of the live version
        self._refit_target = None  # (seq, path, version)
        # The newest version requested while no server was up: servers that come back are
        # refit to it (not to the older live one), so the engine cannot stay behind forever.
        self._deferred: Optional[Tuple[str, int]] = None
        self._refit_seq = self._refit_done = 0
        self._refit_error: Dict[int, str] = {}
        self._threads: List[threading.Thread] = []

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int:
        """The version every server in routing serves."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_flight(self) -> int:
        """Samples on the servers now."""
        return self._occupancy.current_level

    def running_jobs(self) -> list:  # holds cv
        return [j for s in self.servers for j in s.jobs]

    # ------------------------------------------------------------------ routing

    def pick(self) -> Optional[Server]:  # holds cv
        """The healthy server with the most room relative to its capacity; None if full."""
        ready = [s for s in self.servers if s.up and s.in_flight < s.capacity]
        return min(ready, key=lambda s: s.in_flight / s.capacity) if ready else None

    def assign(self, job, server: Server) -> None:  # holds cv
        job.server, job.sent_version = server, server.version
        job.adapter = server.adapter
        server.jobs.add(job)
        self._change_in_flight(server, len(job.samples))

    def release(self, job) -> None:
        """The job's server answered (or failed): its samples leave the server."""
        with self._cv:
            job.server.jobs.discard(job)
            self._change_in_flight(job.server, -len(job.samples))
            self._cv.notify_all()
            stale = self.lora and job.adapter not in (None, job.server.adapter)
        if stale:  # maybe the last job on an old adapter
            self._unload_stale(job.server)

    def _change_in_flight(self, s: Server, delta: int) -> None:  # holds cv
        self._occupancy.level(delta)
        s.in_flight += delta

    # ------------------------------------------------------------------ startup / health

    def bring_up(self, wait_ready: bool) -> None:
        """Waits up to `health_deadline_s` for the servers' /health (`wait_ready`), or
        routes to every server at once."""
        if wait_ready:
            self._wait_ready(self.config.health_deadline_s)
        else:
            for s in self.servers:
                s.up, s.reason = True, None

    def read_versions(self, version: Optional[int]) -> int:
        """Reads each server's weight version (a server without a label holds `version`);
        returns the starting version: `version`, or (None) the oldest the servers report."""
        for s in self.servers:
            if s.up and self.lora:  # its label names the base; no adapter is loaded yet
                s.version = -1 if version is None else int(version)
            elif s.up:  # a server without a label (sglang-jax) holds `version`
                label = self._model_info(s)
                s.version = version_of(label) if label is not None or version is None \
                    else int(version)
        if version is None:
            version = min((s.version for s in self.servers if s.up), default=-1)
        self._version = self._newest = int(version)
        return self._version

    def start_threads(self) -> None:
        """Starts the refit and monitor threads."""
        self._threads = [threading.Thread(target=f, daemon=True, name=f"{self.name}-{n}")
                         for n, f in (("refit", self._refit_loop),
                                      ("monitor", self._monitor_loop))]
        for t in self._threads:
            t.start()

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

        threads = [threading.Thread(target=wait, args=(s,), daemon=True) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not any(s.up for s in self.servers):
            raise TimeoutError(f"no SGLang server answered /health within {deadline_s}s "
                               f"(sglang.health_deadline_s): {list(self.config.urls)}")
        for s in self.servers:
            if not s.up:
                log.warning("SGLang server %s is not ready (%s); routing around it", s.url,
                            s.reason)

    def _model_info(self, s: Server) -> Any:
        try:
            return (s.client.get("/get_model_info", timeout=self.config.control_timeout_s)
                    or {}).get("weight_version")
        except (HTTPError, ServerUnavailable):
            return None

    def mark_down(self, s: Server, reason: str) -> None:
        """Takes `s` out of routing (its requests go to the others) until it answers again."""
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
            for s in [s for s in self.servers if not s.up]:
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
                        self._counts["refits"] += 1
                        self._counts["deferred_refits"] += 1
                    if self._version != version:  # a newer one went live meanwhile: again
                        continue
                    s.up, s.reason = True, None
                    s.counts["readmitted"] += 1
                    self._cv.notify_all()
                log.warning("SGLang server %s is back in routing", s.url)

    # ------------------------------------------------------------------ pause

    def pause(self) -> None:
        """Pauses every server (requests stay on them); the engine stops dispatching."""
        with self._cv:
            self._paused = True
        mode = "retract" if self.config.pause_mode == "abort" else self.config.pause_mode
        for s in [s for s in self.servers if s.up]:
            try:
                s.client.post("/pause_generation", {"mode": mode},
                              timeout=self.config.control_timeout_s)
            except (HTTPError, ServerUnavailable) as e:
                self.mark_down(s, str(e))

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()
        for s in [s for s in self.servers if s.up]:
            try:
                s.client.post("/continue_generation", {}, timeout=self.config.control_timeout_s)
            except (HTTPError, ServerUnavailable) as e:
                self.mark_down(s, str(e))

    # ------------------------------------------------------------------ weights

    def check_newer(self, version: int, allow_older: bool) -> None:
        """Raises unless `version` may be installed (see `InferenceEngine.update_weights`)."""
        with self._cv:
            self._check_newer(version, allow_older)

    def _check_newer(self, version: int, allow_older: bool) -> None:  # holds cv
        if self._stop.is_set():
            raise EngineClosedError(f"engine {self.name} is closed")
        check_version_order(version, self._newest, self._version, allow_older)

    def refit(self, path: str, version: int, *, wait: bool = True,
              timeout: Optional[float] = None, allow_older: bool = False) -> None:
        """Refits every server to the HF directory `path` as `version` (coalesced: while a
        refit runs, only the newest pending version is applied next); with `wait`, returns
        once it is live, raising if no server could install it."""
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
            while self._refit_done < seq and not self._stop.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"update_weights: version {version} not live after "
                                       f"{timeout}s (engine at {self._version})")
                self._cv.wait(left)
            if seq in self._refit_error:
                raise RuntimeError(self._refit_error.pop(seq))
            if self._refit_done < seq:
                raise EngineClosedError(f"engine closed before version {version} went live")

    def _refit_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop.is_set() and self._refit_target is None:
                    self._cv.wait()
                if self._stop.is_set():
                    return
                (seq, path, version), self._refit_target = self._refit_target, None
                servers = [s for s in self.servers if s.up]
            results = self._refit_all(servers, path, version)
            ok = [s for s, (good, _) in zip(servers, results) if good]
            with self._cv:
                if ok:
                    self._version, self._path = version, path
                    self._counts["refits"] += 1
                    if self._deferred is not None and self._deferred[1] <= version:
                        self._deferred = None
                elif self._refit_target is not None and not os.path.isdir(path):
                    # The learner garbage-collected it under a newer version: apply that one.
                    self._counts["refits_superseded"] += 1
                else:
                    if not servers:
                        self._deferred = (path, version)  # installed when a server is back
                    msgs = "; ".join(f"{s.url}: {m}" for s, (_, m) in zip(servers, results))
                    self._refit_error[seq] = (f"update_weights: version {version} could not be "
                                              f"installed on any server ({msgs or 'none up'})")
                    self._counts["refit_failures"] += 1
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
        """Installs `version` on one server (full weights: `_load_weights`; LoRA:
        `_load_adapter`) and records it; (ok, message). After a failed load SGLang keeps
        serving what it had: the server stays in routing (its tokens carry their true version)
        and the failure is reported."""
        what = "loading the adapter of version" if self.lora else "refit to version"
        t0 = time.perf_counter()
        try:
            adapter = (self._load_adapter if self.lora else self._load_weights)(s, path, version)
        except HTTPError as e:
            msg = f"{what} {version} failed: {e.message}"
            log.warning("SGLang server %s: %s", s.url, msg)
            with self._cv:
                s.refit_error = msg
            return False, msg
        except ServerUnavailable as e:
            self.mark_down(s, str(e))
            return False, str(e)
        dt = time.perf_counter() - t0
        with self._cv:
            if adapter is not None:
                s.adapters.add(adapter)
                s.adapter = adapter
            s.version = version
            s.refits += 1
            s.refit_s_total += dt
            s.last_refit_s = dt
            s.refit_error = None
        if adapter is not None:
            self._unload_stale(s)
        return True, ""

    def _load_weights(self, s: Server, path: str, version: int) -> None:
        """pause -> update_weights_from_disk -> continue (unless the fleet is paused)."""
        mode = self.config.pause_mode
        timeout = self.config.control_timeout_s
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

    def _load_adapter(self, s: Server, path: str, version: int) -> str:
        """`/load_lora_adapter` of the PEFT directory `path` under a fresh name, which new
        jobs then name; returns the name (nothing is registered when it fails)."""
        with self._cv:
            self._adapter_seq += 1
            name = f"v{version}.{self._adapter_seq}"
        answer = s.client.post("/load_lora_adapter", {"lora_name": name, "lora_path": path},
                               timeout=self.config.control_timeout_s) or {}
        if answer.get("success") is False:
            raise HTTPError(s.url, "/load_lora_adapter", 200, str(answer.get("error_message")))
        return name

    def _unload_stale(self, s: Server) -> None:
        """Unloads `s`'s adapters that are neither its newest nor named by a job of ours on
        it (claimed under the lock, so two threads never unload one twice). An adapter the
        server no longer has (restarted, or evicted by its `--max-loaded-loras`) counts as
        unloaded."""
        with self._cv:
            used = {j.adapter for j in s.jobs}
            stale = sorted(a for a in s.adapters if a != s.adapter and a not in used)
            s.adapters.difference_update(stale)
        for name in stale:
            try:
                s.client.post("/unload_lora_adapter", {"lora_name": name},
                              timeout=self.config.control_timeout_s, retries=1)
                with self._cv:
                    s.counts["adapters_unloaded"] += 1
            except HTTPError as e:
                if "does not exist" not in e.message:
                    log.warning("SGLang server %s: unloading adapter %s failed: %s", s.url,
                                name, e.message)
                    with self._cv:
                        s.counts["unload_failures"] += 1
            except ServerUnavailable as e:
                log.warning("SGLang server %s: unloading adapter %s failed: %s", s.url, name, e)

    # ------------------------------------------------------------------ reports

    def health(self) -> dict:  # holds cv
        up = [s.url for s in self.servers if s.up]
        down = {s.url: s.reason for s in self.servers if not s.up}
        return {"error": None if up else f"no SGLang server in routing: {down}",
                "servers_up": up, "servers_down": down,
                "refit_errors": {s.url: s.refit_error for s in self.servers if s.refit_error}}

    def roll_window(self, now: float):  # holds cv
        """(occupancy counts `slot_s`, `busy_s` over the window, its span); starts the next."""
        self._occupancy.level(0, now)  # close the occupancy integrals
        return self._occupancy.roll(now)

    def capacity(self) -> int:  # holds cv
        """Samples the servers in routing take at once."""
        return sum(s.capacity for s in self.servers if s.up)

    def stats(self) -> dict:  # holds cv
        """The fleet's totals and per-server figures (`SGLangEngine.stats`)."""
        c = self._counts
        refit_times = [s.last_refit_s for s in self.servers if s.last_refit_s is not None]
        servers = [{
            "url": s.url, "up": s.up, "reason": s.reason, "in_flight": s.in_flight,
            "version": s.version, "refits": s.refits, "last_refit_s": s.last_refit_s,
            "refit_error": s.refit_error,
            "mean_refit_s": s.refit_s_total / s.refits if s.refits else None,
            "requests": s.counts["requests"], "errors": s.counts["errors"],
            "tokens": s.counts["tokens"], "removed": s.counts["removed"],
            "retries": s.client.retries,
            **({"adapter": s.adapter, "adapters_loaded": len(s.adapters),
                "adapters_unloaded": s.counts["adapters_unloaded"],
                "unload_failures": s.counts["unload_failures"]} if self.lora else {}),
            } for s in self.servers]
        return {
            "refits": c["refits"], "last_refit_s": max(refit_times) if refit_times else None,
            "refit_failures": c["refit_failures"], "deferred_refits": c["deferred_refits"],
            "refits_superseded": c["refits_superseded"],
            "retries": sum(s.client.retries for s in self.servers),
            "servers_up": sum(s.up for s in self.servers),
            "servers_down": [s.url for s in self.servers if not s.up],
            "servers": servers,
        }

    def close_clients(self) -> None:
        """Unblocks threads still waiting on an unresponsive server."""
        for s in self.servers:
            s.client.close()
