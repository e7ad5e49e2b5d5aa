"""scripts/device_check.sh: the accelerator check's driver, run here in its --cpu form."""
import json
import os
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from pipelinerl_jax import run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import device_check  # noqa: E402


def _config(overrides):
    """configs/default.py with `--config.*` overrides, parsed as experiments/train.py does."""
    argv = ["train.py", f"--config={os.path.join(ROOT, 'configs', 'default.py')}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_train_overrides_make_a_valid_split(mode, monkeypatch):
    monkeypatch.setattr(run_config.resources, "detect_device_count", lambda *_: 1 if
                        mode == "gpu" else 0)  # one GPU on the host, whatever this one has
    cfg = _config(device_check.train_overrides(mode, device_check.TRAIN_STEPS[mode]))
    run_config.validate(cfg)
    res = cfg.resources
    assert cfg.learner.total_steps == device_check.TRAIN_STEPS[mode]
    if mode == "gpu":  # learner and sampler on the one GPU, sharing its memory
        assert (res.platform, res.learner_devices, res.sampler_devices) == ("gpu", "0", "0")
        env = run_config.resources.role_env(res, "learner")
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert 0 < float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= 0.5
    else:
        assert (res.platform, res.learner_devices, res.sampler_devices) == ("cpu", "0", "1")


def test_requirements_are_read_from_setup_py():
    reqs = device_check.check_requirements()
    assert {"jax", "flax", "optax", "ml-collections", "grpcio"} <= set(reqs)
    assert all(v["have"] and v["ok"] is not False for v in reqs.values()), reqs


@pytest.mark.bench_smoke
@pytest.mark.slow
def test_cpu_mode_prints_one_json_line_with_every_part(device_check_cpu):
    returncode, result, out, _ = device_check_cpu  # tests/conftest.py: run once per session
    assert returncode == 0, json.dumps(result)[-3000:]
    assert json.loads((out / "device_check.json").read_text()) == result
    assert result["mode"] == "cpu" and result["ok"] is True
    assert set(device_check.PARTS) == {"env", "model", "lora", "engine", "paged", "train"}
    assert set(device_check.PARTS) <= set(result)
    assert all(result[k]["status"] == "ok" for k in device_check.PARTS)
    assert result["env"]["backend"] == "cpu" and result["env"]["requirements_unmet"] == {}
    assert "install" not in result["env"]  # no editable install (it fails offline)
    # the random checkpoint, written once on the host before the parts that load it, each of
    # which was handed it (its log names the file loaded); its progress lines are in the log
    ckpt = result["checkpoint"]
    assert ckpt["status"] == "ok" and ckpt["time_s"] > 0 and ckpt["shape"] == "tiny-qwen2"
    assert ckpt["bytes"] > 4 * ckpt["params"] and os.path.isfile(
        os.path.join(ckpt["path"], "config.json"))
    assert result["model"]["checkpoint"] == result["engine"]["checkpoint"] == ckpt["path"]
    assert result["lora"]["checkpoint"] == ckpt["path"]
    for part in ("model", "lora", "engine"):
        assert f"--checkpoint={ckpt['path']}" in (out / f"{part}.log").read_text()
    assert result["model"].get("checkpoint_write_s") is None  # given, not written
    for part, phase in (("model", "learner: train step compiled"),
                        ("engine", "engine: batch 1 dense warm-up"),
                        ("lora", "lora: timed step 1/1"), ("paged", "engine built and warmed")):
        assert phase in (out / f"{part}.log").read_text(), part
    model = result["model"]
    assert model["step_s"] > 0 and 0 < model["mfu"] < 2 and model["peaks"]["matmul_gflops"] > 0
    lora = result["lora"]
    assert 0 < lora["publish_bytes_ratio"] < 1 and 0 < lora["learner_state_bytes_ratio"] < 1
    assert lora["full_step_s"] > 0 and lora["lora_step_s"] > 0 and lora["lora_compile_s"] > 0
    engine = result["engine"]
    assert all(engine[f"batch_{b}"]["tokens_per_s"] > 0 for b in (1, 8))
    assert "paged" not in engine  # on CPU the paged engine is the paged part's
    paged = result["paged"]  # bench_paged --smoke: counts, and paged's tokens equal dense's
    assert paged["greedy_tokens_identical"] == 1.0 and paged["sequences"] == 16
    assert paged["dense_mean_active"] > 0 and paged["paged_mean_active"] > 0
    assert paged["prefills_per_group"] == 1.0  # the n = 8 groups: one prompt prefill each
    train = result["train"]
    assert train["steps"] == train["steps_wanted"] == device_check.TRAIN_STEPS["cpu"]
    assert train["step_time_s"] > 0 and train["tokens_per_s"] > 0
    for part in device_check.PARTS + ("checkpoint",):
        assert (out / f"{part}.log").exists()


def test_the_gpu_limits_fit_the_total_and_include_the_checkpoint_step():
    gpu = device_check.LIMITS["gpu"]
    assert set(gpu) == set(device_check.PARTS) | {"checkpoint"}
    assert sum(gpu.values()) <= device_check.TOTAL_S["gpu"] <= 575
    assert set(device_check.LIMITS["cpu"]) == set(gpu)
    # every limit leaves its part time to run before the stop, GRACE_S ahead of it
    assert min(gpu.values()) > device_check.GRACE_S
