"""How a learner stopped, as a structured record rather than words in a log.

A learner role that ends on an exception appends to `workdir/events.jsonl`

    {"time_s": ..., "event": "learner_stopped", "reason": "diverged" | "error",
     "error": "TooManySkippedSteps", "message": "..."}

before the exception ends the process (non-zero exit). `reason` is `diverged` when the
learner gave up on `learner.max_consecutive_skips` non-finite steps in a row (a result of the
run, not a crash), `error` otherwise. Whoever supervises runs (the ablation runner) reads it
back with `learner_stops` / `diverged`.
"""
from __future__ import annotations

import os
from typing import List

from pipelinerl_jax.launch.supervisor import record_event

LEARNER_STOPPED = "learner_stopped"


def record_learner_stopped(workdir: str, exc: BaseException) -> None:
    """Appends the `learner_stopped` record of `exc` to `workdir/events.jsonl`."""
    from pipelinerl_jax.learner.loop import TooManySkippedSteps  # jax: roles pin cores first
    reason = "diverged" if isinstance(exc, TooManySkippedSteps) else "error"
    record_event(os.path.join(workdir, "events.jsonl"), LEARNER_STOPPED, reason=reason,
                 error=type(exc).__name__, message=str(exc), pid=os.getpid())


def learner_stops(workdir: str, since: float = 0.0) -> List[dict]:
    """The `learner_stopped` records of `workdir` written at or after time `since`."""
    from pipelinerl_jax.metrics import read_jsonl  # numpy: roles pin cores first
    return [e for e in read_jsonl(os.path.join(workdir, "events.jsonl"))
            if e.get("event") == LEARNER_STOPPED and e.get("time_s", 0.0) >= since]


def diverged(workdir: str, since: float = 0.0) -> bool:
    """Whether a learner of `workdir` stopped on non-finite steps since time `since`."""
    return any(e.get("reason") == "diverged" for e in learner_stops(workdir, since))
