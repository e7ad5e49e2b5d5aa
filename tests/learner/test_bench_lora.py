"""scripts/bench_lora.py --smoke: full fine-tuning vs LoRA on the tiny model. The bytes the
script derives from shapes alone equal those of the states it then builds and trains."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke]  # benchmark scripts, tiny shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_prints_one_json_line_whose_bytes_match_the_real_states():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_lora.py"),
                           "--smoke"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sizes, timed = out["bytes_full_shape"], out["timed"]
    assert timed["layers"] == 2  # the smoke model is timed whole: its bytes are comparable
    for kind in ("full", "lora"):
        assert timed[kind]["learner_state_bytes"] == sizes[kind]["learner_state_bytes"]
        assert timed[kind]["publish_bytes"] == sizes[kind]["publish_bytes"]
        assert timed[kind]["received_bytes"] == sizes[kind]["publish_bytes"]
        assert timed[kind]["step_s"] > 0 and timed[kind]["compile_s"] > 0
    assert 0 < out["publish_bytes_ratio"] < 0.1 and 0 < out["learner_state_bytes_ratio"] < 0.5
    # AdamW: two float32 moments per trained parameter (plus a few scalars)
    lora = sizes["lora"]
    assert 2 * lora["param_bytes"] <= lora["optimizer_bytes"] < 2 * lora["param_bytes"] + 1024
