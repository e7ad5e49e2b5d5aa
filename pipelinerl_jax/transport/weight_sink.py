"""Where the learner's weight versions land on disk for engines that load them from there."""
from __future__ import annotations

import os


def weights_dir(cfg, workdir: str) -> str:
    """`sampler.weights_dir`, or WORKDIR/weights when unset."""
    return cfg.sampler.weights_dir or os.path.join(workdir, "weights")
