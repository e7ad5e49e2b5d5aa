"""Capped exponential backoff with jitter: the delay between retries of every client here (the
queue client, the weight subscriber, the SGLang client).

Jitter draws each delay from [d/2, d] so that clients that failed together (a queue restart)
do not retry in lockstep. Why our own loops and not gRPC's service-config retry policy: see
`queue_client`'s module docstring.
"""
from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Delay before retry k: d = min(max_s, initial_s * multiplier**k), drawn from [d/2, d]."""
    initial_s: float = 0.02
    max_s: float = 2.0
    multiplier: float = 2.0

    def delay(self, attempt: int) -> float:
        d = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 30))
        return random.uniform(d / 2, d)
