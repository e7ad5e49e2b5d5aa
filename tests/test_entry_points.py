"""The experiment entry points load every config under configs/ as the docs show them:
`python experiments/<x>.py --config=configs/<y>.py` from the repo root, with no PYTHONPATH.
Configs such as configs/sampler_bound.py import the `configs` package, which Python does not
find from `python experiments/train.py` (sys.path[0] is experiments/) unless the entry point
puts the repo root on the path (it failed with ModuleNotFoundError before, 2026-12-01)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("entry", ["train", "sft", "replay"])
def test_config_importing_configs_package_loads_without_pythonpath(tmp_path, entry):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # ':bogus' makes configs/sampler_bound.py raise its own error once it has been imported
    proc = subprocess.run([sys.executable, f"experiments/{entry}.py",
                           "--config=configs/sampler_bound.py:bogus", f"--workdir={tmp_path}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "ModuleNotFoundError" not in proc.stderr, proc.stderr[-2000:]
    assert "unknown config argument 'bogus'" in proc.stderr, proc.stderr[-2000:]
