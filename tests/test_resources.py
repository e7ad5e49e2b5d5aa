"""One host split between roles: `resources.*` -> each child's platform environment.

The GPU and TPU mappings are pure functions tested against what JAX and libtpu document:
- GPU (docs.jax.dev "GPU memory allocation"): a process sees the GPUs in
  CUDA_VISIBLE_DEVICES; each JAX process preallocates 75% of a GPU's memory unless
  XLA_PYTHON_CLIENT_PREALLOCATE=false, and XLA_PYTHON_CLIENT_MEM_FRACTION caps its pool, so
  processes sharing a GPU need both.
- TPU (jax/_src/test_multiprocess.py, JAX's launcher of several processes on one TPU host,
  and gist.github.com/skye/f82ba45d2445bb19d53545538754f9a3): a process opens the chips in
  TPU_VISIBLE_CHIPS, shaped by TPU_CHIPS_PER_PROCESS_BOUNDS (1 chip 1,1,1; 2 chips 1,2,1;
  4 chips 2,2,1; 8 chips 2,4,1); an independent process is a slice of its own
  (TPU_PROCESS_BOUNDS=1,1,1) with its own TPU_PROCESS_PORT / TPU_PROCESS_ADDRESSES; a chip
  is opened by one process only.
The CPU path runs for real: a child started with the launcher's environment for
`learner_devices='0-1'` sees two JAX devices and is pinned to those cores.
"""
import json
import os
import sys

import pytest

from pipelinerl_jax import resources, run_config
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.launch import launcher
from pipelinerl_jax.launch.supervisor import Child, tail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _res(**kw):
    r = resources.resources_config()
    r.update(kw)
    return r


def _env(res, role, index=0, workers=1, base=None, kind="jax"):
    return resources.role_env(res, role, index, num_workers=workers, sampler_kind=kind,
                              base=base or {})


# ============================================================================ GPU

def test_gpu_split_gives_each_process_its_own_gpus_and_keeps_preallocation():
    res = _res(platform="gpu", learner_devices="0-3", sampler_devices="4-7")
    assert _env(res, "learner", workers=2) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert _env(res, "sft", workers=2) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert _env(res, "worker", 0, workers=2) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert _env(res, "worker", 1, workers=2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert _env(res, "queue", workers=2, base={"A": "1"}) == {"A": "1"}  # no devices
    # Indices are positions in the launcher's own CUDA_VISIBLE_DEVICES.
    env = _env(res, "worker", 1, workers=2, base={"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"})
    assert env["CUDA_VISIBLE_DEVICES"] == "14,15"


def test_processes_sharing_a_gpu_turn_preallocation_off_and_cap_their_fraction():
    res = _res(platform="gpu", learner_devices="0", sampler_devices="0", gpu_memory_fraction=0.45)
    for role in ("learner", "worker"):
        env = _env(res, role, base={"XLA_CLIENT_MEM_FRACTION": "0.9"})
        assert env == {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                       "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}  # jaxlib rejects both names
    # Four workers share two GPUs (worker i on GPU i mod 2); the learner has its own.
    res = _res(platform="gpu", learner_devices="0", sampler_devices="1-2", gpu_memory_fraction=0.5)
    assert [_env(res, "worker", i, workers=4)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == \
        ["1", "2", "1", "2"]
    assert _env(res, "worker", 3, workers=4)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert _env(res, "learner", workers=4) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_sglang_workers_stay_off_the_learners_accelerators():
    res = _res(platform="gpu", learner_devices="0-7")
    assert _env(res, "worker", kind="sglang") == {"JAX_PLATFORMS": "cpu"}
    assert _env(res, "learner", kind="sglang") == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


# ============================================================================ TPU

def test_tpu_v5e8_split_four_and_four_as_libtpu_documents():
    res = _res(platform="tpu", learner_devices="0-3", sampler_devices="4-7")
    assert _env(res, "learner") == {
        "TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
        "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": "8476",
        "TPU_PROCESS_ADDRESSES": "localhost:8476", "CLOUD_TPU_TASK_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    w = _env(res, "worker")
    assert (w["TPU_VISIBLE_CHIPS"], w["TPU_CHIPS_PER_PROCESS_BOUNDS"], w["TPU_PROCESS_PORT"],
            w["TPU_PROCESS_ADDRESSES"]) == ("4,5,6,7", "2,2,1", "8477", "localhost:8477")
    # Two workers split the sampler chips 2 + 2, each a slice of its own on its own port.
    w1 = _env(res, "worker", 1, workers=2)
    assert (w1["TPU_VISIBLE_CHIPS"], w1["TPU_CHIPS_PER_PROCESS_BOUNDS"], w1["TPU_PROCESS_BOUNDS"],
            w1["TPU_PROCESS_PORT"]) == ("6,7", "1,2,1", "1,1,1", "8478")
    one = _env(_res(platform="tpu", learner_devices="0-7", sampler_devices="0"), "learner")
    assert one["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,4,1"
    # A host whose chip grid differs from JAX's table states its rows.
    res.tpu_chip_bounds = "4:4,1,1"
    assert _env(res, "learner")["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "4,1,1"
    assert _env(res, "worker", 1, workers=2)["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"


# ============================================================================ the evaluator

def test_an_evaluator_with_its_own_devices_gets_them_and_otherwise_worker_0s():
    # TPU v5e-8: learner 0-3, worker 4-5, evaluator 6 (its own chip and port, not the CPU).
    res = _res(platform="tpu", learner_devices="0-3", sampler_devices="4-5",
               evaluator_devices="6")
    resources.check_resources(res, platform="tpu", num_workers=1, host_devices=8)
    ev = _env(res, "evaluator")
    assert (ev["TPU_VISIBLE_CHIPS"], ev["TPU_CHIPS_PER_PROCESS_BOUNDS"], ev["TPU_PROCESS_PORT"],
            ev["TPU_PROCESS_ADDRESSES"]) == ("6", "1,1,1", "8478", "localhost:8478")
    assert _env(res, "worker")["TPU_PROCESS_PORT"] == "8477"  # one port per process
    shared = _res(platform="tpu", learner_devices="0-3", sampler_devices="4-7")
    assert _env(shared, "evaluator") == _env(shared, "worker")  # "" = placed as worker 0
    # GPU: its own GPU keeps preallocation; sharing the learner's needs a fraction.
    res = _res(platform="gpu", learner_devices="0-5", sampler_devices="6", evaluator_devices="7")
    assert _env(res, "evaluator") == {"CUDA_VISIBLE_DEVICES": "7"}
    res = _res(platform="gpu", learner_devices="0", sampler_devices="1", evaluator_devices="0",
               gpu_memory_fraction=0.45)
    assert _env(res, "evaluator")["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert _env(res, "learner")["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # CPU: its device count and its cores; without devices, worker 0's cores.
    res = _res(platform="cpu", learner_devices="0-1", sampler_devices="2", evaluator_devices="3")
    assert _env(res, "evaluator")["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
    assert resources.role_cores(res, "evaluator") == [3]
    assert resources.role_cores(_res(platform="cpu", learner_devices="0-1",
                                     sampler_devices="2"), "evaluator") == [2]
    assert "evaluator 3" in resources.describe(res, num_workers=1)


def test_the_launcher_keeps_a_sharing_evaluator_off_a_tpu_chip_but_not_one_with_its_own(
        monkeypatch):
    cfg = run_config.base_config()
    cfg.resources.update(platform="tpu", learner_devices="0-3", sampler_devices="4-7")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert launcher.child_env(cfg, "evaluator")["JAX_PLATFORMS"] == "cpu"
    cfg.resources.update(sampler_devices="4-5", evaluator_devices="6")
    env = launcher.child_env(cfg, "evaluator")
    assert "JAX_PLATFORMS" not in env and env["TPU_VISIBLE_CHIPS"] == "6"


# ============================================================================ CPU

def test_cpu_devices_are_a_device_count_and_the_cores_to_pin():
    res = _res(platform="cpu", learner_devices="0-1", sampler_devices="2")
    env = _env(res, "learner", base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                                                  "--xla_dump_to=/tmp/d"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert resources.role_cores(res, "learner") == [0, 1]
    assert resources.role_cores(res, "worker") == [2]
    assert resources.role_cores(_res(platform="cpu", learner_devices="0-1", learner_cores="5"),
                                "learner") == [5]  # stated cores win
    assert _env(_res(platform="cpu"), "learner", base={"X": "1"}) == {"X": "1"}  # "" = untouched


def _cfg_file(tmp_path, **res):
    cfg = run_config.base_config()
    cfg.resources.update(res)
    cfg.rollout.num_workers = 1
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    return cfg, path


_PROBE = ("import json, os, sys, ml_collections; from pipelinerl_jax.launch import roles; "
          "cfg = ml_collections.ConfigDict(json.load(open(sys.argv[1]))); "
          "cores = roles.pin(cfg, sys.argv[2]); import jax; "
          "print(json.dumps({'devices': jax.device_count(), 'backend': jax.default_backend(), "
          "'cores': sorted(os.sched_getaffinity(0)), 'pinned': cores}))")


@pytest.mark.slow
@pytest.mark.parametrize("role,devices", [("learner", 2), ("worker", 1), ("evaluator", 1)])
def test_a_child_started_with_its_role_env_sees_its_cpu_devices(tmp_path, monkeypatch, role,
                                                                devices):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    cfg, path = _cfg_file(tmp_path, platform="cpu", learner_devices="0-1", sampler_devices="1")
    run_config.validate(cfg)
    env = launcher.child_env(cfg, role)  # what launch() hands the child
    c = Child(role, [sys.executable, "-c", _PROBE, str(path), role],
              str(tmp_path / f"{role}.log"), env=env).start()
    assert c.wait(120, interval=0.1) == 0, tail(c.log_path)
    out = json.loads(tail(c.log_path).strip().splitlines()[-1])
    assert (out["devices"], out["backend"]) == (devices, "cpu")  # the parent test has 8
    want = [0, 1] if role == "learner" else [1]
    have = sorted(os.sched_getaffinity(0))
    assert out["pinned"] == [x for x in want if x in have]
    if out["pinned"]:
        assert out["cores"] == out["pinned"]


# ============================================================================ validation

def _default():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, "configs",
                                                                      "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("res,extra,match", [
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="4-7", evaluator_devices="7"),
     {}, r"^resources\.evaluator_devices: TPU chip 7 would be opened by 2 processes"),
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="4-5", evaluator_devices="8"),
     {"resources.host_devices": 8}, r"^resources\.evaluator_devices: '8' names device 8"),
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="4-5",
          evaluator_devices="5-7"), {},
     r"^resources\.evaluator_devices: gives evaluator chips 5-7: a TPU process needs"),
    (dict(platform="gpu", evaluator_devices="7"), {},
     r"^resources\.evaluator_devices: needs resources\.learner_devices"),
    (dict(platform="gpu", learner_devices="0", sampler_devices="1", evaluator_devices="0"), {},
     r"^resources\.gpu_memory_fraction: GPU 0 is shared by 2 processes"),
    (dict(platform="gpu", learner_devices="0-6", evaluator_devices="7"),
     {"sampler.kind": "sglang", "sglang.urls": ("http://127.0.0.1:30000",),
      "sglang.eval_urls": ("http://127.0.0.1:30001",)},
     r"^resources\.evaluator_devices: must be '' with sampler\.kind='sglang'"),
    (dict(learner_devices="0-x"), {}, r"^resources\.learner_devices: must look like"),
    (dict(sampler_devices="3-1"), {}, r"^resources\.sampler_devices: must look like"),
    (dict(learner_devices="0,0"), {}, r"^resources\.learner_devices: names an index twice"),
    (dict(platform="metal"), {}, r"^resources\.platform: must be one of"),
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="2-5"), {},
     r"^resources\.sampler_devices: .*gives worker0 chips 2-5"),
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="3"), {},
     r"^resources\.sampler_devices: TPU chip 3 would be opened by 2 processes"),
    (dict(platform="tpu", learner_devices="0-2", sampler_devices="4-7"), {},
     r"^resources\.learner_devices: gives learner chips 0-2: a TPU process needs an aligned"),
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="4-7"),
     {"rollout.num_workers": 8}, r"^resources\.sampler_devices: TPU chip 4 would be opened"),
    (dict(platform="gpu", learner_devices="0-1", sampler_devices="1"), {},
     r"^resources\.gpu_memory_fraction: GPU 1 is shared by 2 processes"),
    (dict(platform="gpu", learner_devices="0", sampler_devices="0", gpu_memory_fraction=0.6), {},
     r"^resources\.gpu_memory_fraction: 0\.6 x 2 processes"),
    (dict(platform="gpu", learner_devices="0-3", sampler_devices="4-8"), {},
     r"^resources\.sampler_devices: '4-8' names device 8 but this host has 8 gpu devices"),
    (dict(platform="gpu", learner_devices="0-3"), {},
     r"^resources\.sampler_devices: must be set too on gpu"),
    (dict(platform="gpu", learner_devices="0", sampler_devices="1-3"),
     {"rollout.num_workers": 2}, r"^rollout\.num_workers: 2 workers can neither split"),
    (dict(platform="gpu", learner_devices="0", sampler_devices="1"),
     {"sampler.kind": "sglang", "sglang.urls": ("http://127.0.0.1:30000",),
      "sglang.eval_urls": ("http://127.0.0.1:30001",)},
     r"^resources\.sampler_devices: must be '' with sampler.kind='sglang'"),
    (dict(platform="cpu", learner_devices="0"), {"mesh.shape": (1, 2, 1)},
     r"^mesh\.shape: needs 2 devices but resources\.learner_devices='0'"),
    (dict(gpu_memory_fraction=1.5), {}, r"^resources\.gpu_memory_fraction: must be in"),
    (dict(tpu_chip_bounds="4:2,1,1"), {}, r"^resources\.tpu_chip_bounds: '4:2,1,1': three sizes"),
    (dict(no_such_key=1), {}, r"^resources\.no_such_key: unknown key"),
])
def test_a_split_that_cannot_work_fails_before_start_naming_the_key(res, extra, match):
    cfg = _default()
    cfg.resources.host_devices = 8  # as stated by the user; 0 = detect
    with cfg.unlocked():
        cfg.resources.update(res)
    for key, value in extra.items():
        section, leaf = key.split(".")
        cfg[section][leaf] = value
    with pytest.raises(ConfigError, match=match):
        run_config.validate(cfg)


@pytest.mark.parametrize("res,workers", [
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="4-7"), 2),
    (dict(platform="gpu", learner_devices="0-3", sampler_devices="4-7"), 4),
    (dict(platform="gpu", learner_devices="0", sampler_devices="0", gpu_memory_fraction=0.45), 1),
    (dict(platform="cpu", learner_devices="0-1", sampler_devices="0-1"), 2),  # cores shared
    (dict(platform="tpu", learner_devices="0-3", sampler_devices="4-5", evaluator_devices="6"),
     1),
    (dict(platform="gpu", learner_devices="0", sampler_devices="1", evaluator_devices="1",
          gpu_memory_fraction=0.45), 1),
])
def test_splits_that_work_validate(res, workers):
    cfg = _default()
    cfg.resources.update(res)
    cfg.resources.host_devices = 8
    cfg.rollout.num_workers = workers
    run_config.validate(cfg)


def test_platform_detection_reads_jax_platforms_and_cuda_visible_devices():
    assert resources.detect_platform({"JAX_PLATFORMS": "cuda"}) == "gpu"
    assert resources.detect_platform({"JAX_PLATFORMS": "tpu,cpu"}) == "tpu"
    assert resources.detect_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"
    assert resources.detect_device_count("gpu", {"CUDA_VISIBLE_DEVICES": "2,3"}) == 2
    assert resources.detect_device_count("cpu", {}) == 0  # virtual devices: no limit


def test_index_specs_round_trip():
    for spec in ("0", "0-3", "0-3,6", "1,3,5-7"):
        assert resources.format_indices(resources.parse_indices(spec, "k")) == spec
    assert resources.parse_indices("", "k") == []
