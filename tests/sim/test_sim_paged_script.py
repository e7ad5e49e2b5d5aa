"""scripts/sim_paged_agreement.py --quick: the script runs end to end on the real paged
engine, prints one JSON line and writes its figure; on the engine's own requests the
simulator's chunk model reproduces the engine's trace at both budgets."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke]  # a benchmark script, tiny shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_agrees_and_draws_the_figure(tmp_path):
    out = tmp_path / "agreement.png"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sim_paged_agreement.py"),
                           "--quick", f"--out={out}"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sequences"] == 64 and set(result["budgets"]) == {"512", "1024"}
    for budget in result["budgets"].values():
        same = budget["paged_model_same_draws"]
        assert same["trace_identical"] and same["error"] == 0.0
        assert budget["engine"]["decode_steps"] == same["decode_steps"]
        assert budget["fixed_slots_paged"]["slots"] < budget["fixed_slots_expected"]["slots"]
    assert all(0.9 < v["paged_ratio"] < 1.1 for v in result["long_run_closed_form"].values())
    assert out.stat().st_size > 10_000
