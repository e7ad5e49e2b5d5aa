"""What a rollout worker writes to its run directory (docs/metrics.md), and the engine
stats it reads for them.

- `samples.w<i>.jsonl`: one line per sample of every scored group (the group source's
  members say what a line holds: a completion's or an episode's fields);
- `events.jsonl`: faults the worker rode out (`queue_restart`, `groups_dropped_in_queue`,
  `group_failed`, `group_rejected`, `weights_rollback`), each with `child = worker<i>`;
- `weights_received.w<i>.jsonl`: every weight version the subscriber delivered;
- `engine_stats.jsonl`: every `rollout.stats_every_s`, the engine's window (occupancy,
  throughput, decode step time), the worker's counters, the engine's fault counters where
  it has them (SGLang) and what the group source adds (`env`: the episode runner's counters).

Without a workdir nothing is written (tests).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Optional, Tuple

from pipelinerl_jax.metrics import append_jsonl

# Engine stats totals copied into `engine_stats.jsonl` when the engine reports them.
ENGINE_FAULT_KEYS = ("retries", "rerouted_requests", "request_errors",
                     "server_aborted_segments", "resubmitted_samples",
                     "dropped_aborted_samples", "failed_samples", "servers_up", "refit_failures")


class RolloutLog:
    def __init__(self, workdir: Optional[str], worker_index: int,
                 clock: Callable[[], float] = time.time):
        self.workdir, self.index, self.clock = workdir, worker_index, clock

    def _append(self, name: str, records) -> None:
        if self.workdir:
            append_jsonl(os.path.join(self.workdir, name), records)

    def event(self, event: str, **fields) -> None:
        self._append("events.jsonl", [{"time_s": self.clock(), "event": event,
                                       "child": f"worker{self.index}", **fields}])

    def weights_received(self, version: int) -> None:
        self._append(f"weights_received.w{self.index}.jsonl",
                     [{"time_s": self.clock(), "version": int(version)}])

    def samples(self, records: Iterable[dict]) -> None:
        """`records` may be lazy: they are built only when there is a workdir."""
        if self.workdir:
            self._append(f"samples.w{self.index}.jsonl", list(records))

    def engine_stats(self, now: float, s: dict, worker_counts: dict, extra: dict) -> None:
        self._append("engine_stats.jsonl", [{
            "time_s": now, "engine_id": s["engine_id"], "version": s["version"],
            "occupancy": s["time_occupancy"], "decode_occupancy": s["slot_occupancy"],
            # window means: slots active while decoding, and seconds per decode step
            "active_slots": s["slot_occupancy"] * s["num_slots"],
            "decode_step_time_s": (s["busy_fraction"] * s["window_s"]
                                   / max(s["window_decode_steps"], 1)),
            "num_slots": s["num_slots"], "tokens_per_s": s["tokens_per_s"],
            "busy_fraction": s["busy_fraction"], "queued_samples": s["queued_samples"],
            "decode_steps": s["window_decode_steps"],
            # fault counters: the worker's, and the engine's where it has them (SGLang)
            "worker": dict(worker_counts), **extra,
            **{k: s[k] for k in ENGINE_FAULT_KEYS if k in s}}])


class EngineMonitor:
    """The engine's stats, read at most every `every_s`; `latest` is the last read."""

    def __init__(self, engine, every_s: float, clock: Callable[[], float] = time.time):
        self.engine, self.every_s, self.clock = engine, every_s, clock
        self.latest: dict = {}
        self._last_time = clock()

    def poll(self, force: bool = False) -> Optional[Tuple[float, dict]]:
        """(time, fresh stats) when `every_s` has passed since the last read (or `force`),
        else None."""
        now = self.clock()
        if not force and now - self._last_time < self.every_s:
            return None
        s = self.engine.stats()
        # Time-averaged fraction of slots holding a sample (idle time counts as empty).
        s["time_occupancy"] = float(s.get("slot_occupancy", 0.0) * s.get("busy_fraction", 0.0))
        self.latest = s
        self._last_time = now
        return now, s
