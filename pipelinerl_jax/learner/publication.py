"""Weight publication overlapped with the next train step.

    pub = Publication(ship)                 # ship(version, host_params, *args) -> flat params
    pub.submit(version, state.params, *args)  # after each step: snapshot, then returns
    flat = pub.result()                     # the newest version's flat params (waits)
    pub.close()                             # the run's end: waits for the last one

`submit` takes a snapshot the donated train step cannot invalidate
(`multihost.snapshot_params`: an on-device copy whose device-to-host transfer is started at
once; a multi-process learner's cross-process leaves are gathered to host right there) and
hands it to one background thread, which fetches it to host and calls `ship` (announce the
version to the queue, then deliver it through the weight sink). One thread, first in first
out: versions go out in order and none is skipped (no coalescing). `ship` shares nothing with
the caller's thread by accident: whatever a version needs that the caller may change later
travels as `args`, taken at `submit`. At most one publication is
in flight: `submit` first waits for the previous one, so a publisher slower than the learner
slows the learner down instead of piling up device copies (device memory: one extra copy of
the params). An error in the background is raised in the learner by the next call.

On an accelerator the snapshot is an HBM-to-HBM copy, far cheaper than the device-to-host
transfer it takes off the learner's path; on CPU, where device memory is host memory, the
params are fetched at once and only the delivery moves to the thread. scripts/
bench_weight_sync.py (100M params, CPU): blocking 1.8% of the step, overlapped 0.05%.
"""
from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import numpy as np

from pipelinerl_jax.learner import multihost

log = logging.getLogger(__name__)
Flat = Dict[str, np.ndarray]


class Publication:
    """Publishes versions from a background thread, in order, one in flight at a time.

    `ship(version, host_params, *args) -> flat params`: runs on the background thread.
    `background`: False runs `ship` on the caller's thread (the blocking behaviour).
    `dtype`: floating params are published in it (`learner.publish_dtype`; None: as trained).
    `last_duration_s` (host fetch + ship of the newest publication collected by `submit` or
    `result`) is written on the caller's thread only.
    """

    def __init__(self, ship: Callable[[int, Any], Flat], background: bool = True,
                 dtype=None):
        self._ship, self.dtype = ship, dtype
        self._pool = futures.ThreadPoolExecutor(1, "weight-publish") if background else None
        self._pending: Optional[futures.Future] = None
        self.last_version = -1
        self.last_duration_s = 0.0  # of the newest finished publication (host fetch + ship)

    def _run(self, version: int, snapshot, args) -> Tuple[Flat, float]:
        t = time.perf_counter()
        flat = self._ship(version, jax.device_get(snapshot), *args)
        return flat, time.perf_counter() - t

    def submit(self, version: int, params, *args) -> None:
        """Publishes `params` as `version` (> every version before), handing `args` to `ship`
        with it; returns once the previous publication finished and this one's snapshot is
        taken."""
        if version <= self.last_version:
            raise ValueError(f"version {version} published after {self.last_version}")
        self.result()
        snapshot = multihost.snapshot_params(params, dtype=self.dtype)
        self.last_version = version
        if self._pool is None:
            self._pending = futures.Future()
            self._pending.set_result(self._run(version, snapshot, args))
        else:
            self._pending = self._pool.submit(self._run, version, snapshot, args)

    def result(self) -> Optional[Flat]:
        """Waits for the newest submitted version's publication; its flat host params."""
        if self._pending is None:
            return None
        flat, self.last_duration_s = self._pending.result()
        return flat

    def close(self) -> None:
        """Waits for the last publication (raising its error), then stops the thread."""
        try:
            self.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """`close` on the way out of a failed run: the error of the last publication (the
        run's own error matters more) is logged, not raised."""
        try:
            self.close()
        except Exception:  # noqa: BLE001 - reported, the caller re-raises its own
            log.exception("weight publication of version %d failed", self.last_version)
