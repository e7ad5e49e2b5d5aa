"""Async (or sync) pipeline RL: `python experiments/train.py --config=configs/default.py --workdir=DIR`.

Overrides: `--config.loss.name=tis --config.loss.cap=2.0 --config.mode=sync ...`.
Re-running with the same `--workdir` resumes from the last checkpoint.
"""
import json
import os
import sys

# configs/*.py import the `configs` package: the repo root must be importable
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.config_checks import ConfigError  # noqa: E402
from pipelinerl_jax.launch.supervisor import exit_now  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Experiment config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics, checkpoints, plot).",
                               required=True)


def main(argv):
    del argv
    from pipelinerl_jax.launch import launch
    try:
        summary = launch(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    print(json.dumps(summary, indent=2))
    exit_now(0)  # skips ~1.5 s of tearing down jax & co. at exit (see exit_now)


if __name__ == "__main__":
    app.run(main)
