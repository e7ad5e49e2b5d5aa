"""scripts/bench_population.py (would batching a study cell's seeds pay?) runs end to end on
tiny shapes and reports each figure; no speed is asserted (BENCHMARKS.md has the numbers)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke]  # a benchmark script, tiny shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_population_bench_smoke():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_population.py"),
                           "--small"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["params"] == 20640 and out["one_seed_step_s"] > 0
    assert out["step_s_2_seeds"] > 0 and out["step_per_seed_speedup_2"] > 0
    assert out["engine_tokens_per_s_base"] > 0 and out["engine_per_token_speedup_x2"] > 0
