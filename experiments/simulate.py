"""Systems simulator: sync vs one-step vs async pipeline RL, the split sweep, calibration.

  python experiments/simulate.py --config=configs/sim/talk.py --workdir=/tmp/sim
  python experiments/simulate.py --config=configs/sim/talk.py --config.mode=sweep --workdir=/tmp/sweep
  python experiments/simulate.py --config=configs/sim/tiny.py --config.calibrate_from=RUN_DIR --workdir=/tmp/cal

Writes WORKDIR/summary.json (and a PNG). See docs/sim.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.config_checks import ConfigError  # noqa: E402
from pipelinerl_jax.sim.commands import run  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Simulator config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where summary.json and plots go.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    try:
        run(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:  # a bad description: say which key, no traceback
        sys.exit(f"config error: {e}")


if __name__ == "__main__":
    app.run(main)
