"""scripts/bench_real_size.py --smoke: the real-size benchmark's code path on the tiny model."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.bench_smoke]  # benchmark scripts, tiny shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_smoke_prints_one_json_line(tmp_path, param_dtype, request):
    if param_dtype == "float32":
        # device_check --cpu runs exactly this (its `model` and `engine` parts, float32):
        # read the script's own JSON lines there instead of running it a second time
        _, result, _, part_json = request.getfixturevalue("device_check_cpu")
        assert result["model"]["status"] == result["engine"]["status"] == "ok", result
        out = {**part_json("model"), "engine": part_json("engine")["engine"]}
    else:
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("XLA_FLAGS", None)
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts",
                                                            "bench_real_size.py"),
                               "--smoke", f"--workdir={tmp_path}",
                               f"--param-dtype={param_dtype}"],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == "8 x cpu" and out["learner"]["mesh"] == "1x4x2"
    learner = out["learner"]
    assert learner["step_s"] > 0 and 0 < learner["mfu"] < 2
    # the AdamW update alone, reported apart: part of the step, so the rest is more efficient
    assert 0 < learner["optimizer_s"] and learner["mfu_excl_optimizer"] >= learner["mfu"]
    # against the run's highest peak it can only be lower than against each step's own peak
    assert 0 < learner["mfu_vs_best_peak"] <= learner["mfu"] + 1e-4
    assert learner["param_dtype"] == param_dtype and learner["loss"] == learner["loss"]
    # float32 Adam moments whatever the params' dtype: 2 (float32) or 4 (bf16) times the params
    ratio = learner["opt_bytes_per_device"] / learner["param_bytes_per_device"]
    assert abs(ratio - (4 if param_dtype == "bfloat16" else 2)) < 0.05, ratio
    assert set(out["engine"]) == {"batch_1", "batch_8"}
    assert all(e["tokens_per_s"] > 0 for e in out["engine"].values())


def test_mesh_flag_runs_the_learner_on_one_device(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_real_size.py"),
                           "--smoke", f"--workdir={tmp_path}", "--mesh=1,1,1", "--only=learner"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["learner"]["mesh"] == "1x1x1" and "engine" not in out
    # one device holds every parameter: the 1x4x2 mesh's per-device share times 8
    assert out["learner"]["param_bytes_per_device"] > 0


def test_kv_layout_both_times_dense_and_paged_interleaved(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_real_size.py"),
                           "--smoke", f"--workdir={tmp_path}", "--only=engine",
                           "--kv-layout=both", "--batches=8"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    dense, paged = out["engine"]["batch_8"], out["engine_paged"]["batch_8"]
    assert out["engine_paged"]["attention_impl"] == "reference"  # 'auto' on CPU
    assert paged["tokens_per_s"] > 0 and paged["roofline_tokens_per_s"] == dense[
        "roofline_tokens_per_s"]  # same weights and live KV read: one roofline
    # timed interleaved, --repeats rounds (default 3): the reported ratio is the median of
    # the per-round ratios of tokens/s, each round's listed with their min / max
    assert len(dense["round_tokens_per_s"]) == len(paged["round_tokens_per_s"]) == 3
    assert dense["tokens_per_s"] == pytest.approx(np.median(dense["round_tokens_per_s"]),
                                                  abs=0.1)
    rounds = out["paged_vs_dense_rounds"]["batch_8"]
    assert rounds == pytest.approx([p / d for d, p in zip(dense["round_tokens_per_s"],
                                                          paged["round_tokens_per_s"])],
                                   abs=2e-3)
    assert out["paged_vs_dense_of_roofline"]["batch_8"] == pytest.approx(np.median(rounds),
                                                                         abs=1e-3)
    assert out["paged_vs_dense_range"]["batch_8"] == [min(rounds), max(rounds)]


def _weight_sync_bench(*args) -> dict:
    """scripts/bench_weight_sync.py's final JSON line."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_weight_sync.py"),
                           *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_weight_sync_bench_smoke():
    """scripts/bench_weight_sync.py --small: both publication modes through a real StreamSink."""
    out = _weight_sync_bench("--small", "--steps=3", "--seq=16")
    for mode in ("blocking", "overlapped"):
        m = out[mode]
        assert m["step_s"] > 0 and m["publish_blocking_s"] >= 0
        assert abs(m["sync_fraction"] - m["publish_blocking_s"] / m["step_s"]) < 0.01, m


def test_decode_attention_bench_smoke():
    """scripts/bench_decode_attention.py --smoke: both layouts timed interleaved, and what XLA
    emitted for each reported (the transpose count is the benchmark's figure, BENCHMARKS.md;
    a smoke test asserts no figure)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts",
                                                        "bench_decode_attention.py"), "--smoke"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["layers"] == 2 and out["rounds"] == 4
    assert out["dense_ms"] > 0 and out["paged_ms"] > 0 and out["paged_speed_vs_dense"] > 0
    q1, q3 = out["paged_speed_vs_dense_quartiles"]
    assert q1 <= out["paged_speed_vs_dense"] <= q3
    for layout in ("dense", "paged"):
        assert set(out["hlo_ops"][layout]) == {"transpose", "copy", "gather", "dot"}
        assert out["hlo_ops"][layout]["dot"] > 0


def test_weight_sync_live_bench_smoke():
    """scripts/bench_weight_sync.py --live --small: publish -> live in a JaxEngine, full and
    LoRA, each full copy measured; on CPU a full version of a matching dtype takes at most
    three (frames once, the subscriber's buffer, the transfer to the engine's device, which
    jax may skip by aliasing the buffer)."""
    out = _weight_sync_bench("--live", "--small", "--versions=2")
    copies = dict(out["full_copies"])
    assert copies.pop("host_to_device") in (0, 1)  # jax may alias an aligned host array
    assert copies == {"snapshot": 0, "device_to_host": 0, "frame_assembly": 1.0,
                      "subscriber_buffer": 1, "host_cast": 0.0}, out["full_copies"]
    assert out["full_host_copies"] <= 3.0
    assert out["lora_bytes"] < out["full_bytes"] / 4
    assert out["lora_to_full_publish_to_live_ratio"] == pytest.approx(
        out["lora_publish_to_live_s"] / out["full_publish_to_live_s"], abs=1e-3)
