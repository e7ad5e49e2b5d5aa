"""Supervised warm start on a task's demonstrations; writes `WORKDIR/model` (HF format).

    python experiments/sft.py --config=configs/default.py --workdir=runs/sft

Pass the result to RL with `--config.warm_start.checkpoint=runs/sft/model`.
"""
import json
import os
import sys

# configs/*.py import the `configs` package: the repo root must be importable
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.config_checks import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Experiment config.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.", required=True)


def main(argv):
    del argv
    from pipelinerl_jax import run_config
    from pipelinerl_jax.launch.roles import evaluated_sft
    cfg = _CONFIG.value
    try:
        run_config.validate(cfg)
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    cfg = run_config.resolve(cfg)  # the derived values every role reads
    print(json.dumps(evaluated_sft(cfg, _WORKDIR.value), indent=2))


if __name__ == "__main__":
    app.run(main)
