"""scripts/bench_reshard.py --smoke: the reshard benchmark's code path (a learner mesh on 4 of
8 CPU devices, the engine's shardings on 2 others) at 2 layers; every arm lands in the
engine's shardings with the learner's values (the script checks) and is timed."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke]  # a benchmark script, tiny shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_reshard_bench_smoke():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_reshard.py"),
                           "--smoke"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 2 and out["tensors"] == 26
    for arm in ("one_device_put", "per_tensor", "from_host"):
        assert out[f"{arm}_s"] > 0 and out[f"{arm}_gb_per_s"] > 0
