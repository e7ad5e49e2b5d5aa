"""scripts/bench_real_size.py --smoke: the real-size benchmark's code path on the tiny model."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_prints_one_json_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_real_size.py"),
                           "--smoke", f"--workdir={tmp_path}"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == "8 x cpu" and out["learner"]["mesh"] == "1x4x2"
    learner = out["learner"]
    assert learner["step_s"] > 0 and 0 < learner["mfu"] < 2
    assert 0 < learner["param_bytes_per_device"] < learner["opt_bytes_per_device"]
    assert set(out["engine"]) == {"batch_1", "batch_8"}
    assert all(e["tokens_per_s"] > 0 for e in out["engine"].values())
