"""scripts/bench_real_size.py --smoke: the real-size benchmark's code path on the tiny model."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_smoke_prints_one_json_line(tmp_path, param_dtype):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_real_size.py"),
                           "--smoke", f"--workdir={tmp_path}", f"--param-dtype={param_dtype}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == "8 x cpu" and out["learner"]["mesh"] == "1x4x2"
    learner = out["learner"]
    assert learner["step_s"] > 0 and 0 < learner["mfu"] < 2
    assert learner["param_dtype"] == param_dtype and learner["loss"] == learner["loss"]
    # float32 Adam moments whatever the params' dtype: 2 (float32) or 4 (bf16) times the params
    ratio = learner["opt_bytes_per_device"] / learner["param_bytes_per_device"]
    assert abs(ratio - (4 if param_dtype == "bfloat16" else 2)) < 0.05, ratio
    assert set(out["engine"]) == {"batch_1", "batch_8"}
    assert all(e["tokens_per_s"] > 0 for e in out["engine"].values())
