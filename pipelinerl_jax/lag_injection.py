"""Lag injection: every trained token at an exact, prescribed staleness (the staleness
ablations, `configs/ablate/staleness.py`).

The run is lock-step: learner step L's batch is sampled with the weights of policy version
`L - k_L`, where k_L is fixed or drawn from a seeded distribution (`injected_lag`). The
learner keeps the params of the last `max_k` versions (`LagInjector`, saved in its
checkpoints too) and ships, as weight-stream version L, the params of policy version
`L - k_L`, with that policy version in the weight header. The rollout worker installs them
as that version, so every token has lag exactly k_L, independent of timing and across
restarts.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np


def injected_lag(cfg_inj, step: int) -> int:
    """The lag prescribed for learner step `step` (deterministic in (seed, step))."""
    if cfg_inj.kind == "fixed":
        k = cfg_inj.k
    else:
        rng = np.random.default_rng([cfg_inj.seed, step])
        if cfg_inj.kind == "uniform":
            k = int(rng.integers(0, cfg_inj.max_k + 1))
        else:  # geometric with mean k, truncated at max_k
            k = min(int(rng.geometric(1.0 / (cfg_inj.k + 1.0))) - 1, cfg_inj.max_k)
    return int(min(k, step))


class LagInjector:
    """The learner's side: which version's params to ship as each new version.

    `history` ({version: host params}) holds the versions that may still be shipped; it is
    what the learner checkpoints and hands back here on restore.
    """

    def __init__(self, cfg_inj, history: Optional[Dict[int, Any]] = None):
        self.cfg = cfg_inj
        self.history: Dict[int, Any] = dict(history or {})

    def ship(self, version: int, params) -> Tuple[int, Any]:
        """Records `params` as `version`; returns `(policy_version, its params)`: what goes
        out as weight-stream version `version`."""
        self.history[version] = jax.device_get(params)
        for v in [v for v in self.history if v < version - self.cfg.max_k]:
            del self.history[v]
        policy_version = version - injected_lag(self.cfg, version)
        return policy_version, self.history[policy_version]
