"""Which accelerators and cores each role of a run gets on one host (config section `resources`).

On one accelerator host (a TPU v5e-8 VM, an 8-GPU node) the learner and the rollout workers
are separate JAX processes, and left alone each would open every accelerator: a TPU chip can
be opened by one process only, and on GPU each process preallocates 75% of the memory.
`resources.learner_devices` / `resources.sampler_devices` ("0-3" / "4-7"; "" leaves the
process's environment as it is) give each role its own, and `role_env` turns them into the
child's environment, which JAX reads when it starts:

* gpu: `CUDA_VISIBLE_DEVICES`; on a GPU it shares with another process also
  `XLA_PYTHON_CLIENT_PREALLOCATE=false` and `XLA_PYTHON_CLIENT_MEM_FRACTION` =
  `resources.gpu_memory_fraction`;
* tpu: `TPU_VISIBLE_CHIPS`, `TPU_CHIPS_PER_PROCESS_BOUNDS`, `TPU_PROCESS_BOUNDS=1,1,1`, its
  own `TPU_PROCESS_PORT` / `TPU_PROCESS_ADDRESSES`, `ALLOW_MULTIPLE_LIBTPU_LOAD=1`;
* cpu: `JAX_PLATFORMS=cpu`, `--xla_force_host_platform_device_count=N` in `XLA_FLAGS`, and
  pinned to the cores with its device indices (unless `resources.*_cores` names others).

Indices are chips on TPU (one JAX device per chip from v4 on), GPUs on GPU (positions in the
launcher's own `CUDA_VISIBLE_DEVICES` when it has one), virtual devices and cores on CPU. The
SFT warm start gets the learner's devices; the queue server (no JAX) is left as it is.

The evaluator (held-out evaluation, `learner.eval_every` > 0) takes
`resources.evaluator_devices` when given (e.g. "8": its own chip or GPU, so that it neither
slows worker 0 nor, on TPU, falls back to the CPU); left "", it is placed as worker 0 (its
cores and devices; the launcher then turns GPU preallocation off for it, and on TPU, where
worker 0 holds the chips, keeps it on the CPU). With `sampler.kind='sglang'` it is an HTTP
client of `sglang.eval_urls` and takes no devices.

Workers. With W = `rollout.num_workers` workers and S sampler devices: when W divides S they
split them (worker i takes the i-th block of S/W); when S divides W they share them (worker i
takes device i mod S). Sharing a GPU needs `resources.gpu_memory_fraction` (every process on
it gets that fraction; their sum must fit); a TPU chip cannot be shared. With
`sampler.kind='sglang'` the workers only talk HTTP: the servers' GPUs are given to
`scripts/launch_sglang.py --gpus`, so `sampler_devices` stays "" and the workers run JAX on
CPU once the learner has devices.

`check_resources` (called by `run_config.validate`, before any process starts) rejects a
malformed spec, an index past the host's device count (`resources.host_devices`, or detected
from /dev), overlapping TPU chips, a GPU shared without a memory fraction, and a learner mesh
larger than its devices, each with a `ConfigError` naming the key.
"""
from __future__ import annotations

import glob
import importlib.util
import math
import re
from collections import Counter
from typing import Dict, List, Mapping, Optional, Sequence

import ml_collections

from pipelinerl_jax.config_checks import ConfigError

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
# Chips in one TPU process -> TPU_CHIPS_PER_PROCESS_BOUNDS (the chip sub-block's x,y,z shape),
# as JAX's own launcher of several processes on one TPU host sets them
# (jax/_src/test_multiprocess.py: 1 -> 1,1,1; 2 -> 1,2,1; 4 -> 2,2,1; 8 -> 2,4,1). It notes
# its 4-chip row fits a 2x4 v6e host, not a 4x2 v5e one: `resources.tpu_chip_bounds` replaces
# rows (e.g. "4:4,1,1") where the host's chip grid differs.
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


def resources_config() -> ml_collections.ConfigDict:
    """Defaults of the `resources` section (see the module docstring)."""
    return ml_collections.ConfigDict(dict(
        learner_cores="",  # e.g. "0" or "0-3"; "" = no pinning (all cores)
        sampler_cores="",  # cores for the rollout workers (shared among them)
        platform="auto",  # what *_devices index: 'auto' (detected) | 'cpu' | 'gpu' | 'tpu'
        learner_devices="",  # e.g. "0-3": the learner's (and SFT's) devices; "" = untouched
        sampler_devices="",  # e.g. "4-7": the rollout workers' (split or shared evenly)
        evaluator_devices="",  # e.g. "8": the evaluator's own; "" = worker 0's (shared)
        host_devices=0,  # devices on this host; 0 = detect (gpu, tpu) or no limit (cpu)
        gpu_memory_fraction=0.0,  # per process on a GPU two processes share (0 = none)
        tpu_port=8476,  # learner's TPU_PROCESS_PORT; worker i uses tpu_port + 1 + i
        tpu_chip_bounds="",  # e.g. "4:1,4,1": rows replacing TPU_CHIP_BOUNDS ("" = JAX's)
    ))


def parse_indices(spec: str, key: str) -> List[int]:
    """'0,2-3' -> [0, 2, 3]; '' -> []. Duplicates and empty ranges are errors."""
    out = []
    try:
        for part in filter(None, str(spec).replace(" ", "").split(",")):
            lo, _, hi = part.partition("-")
            lo, hi = int(lo), int(hi or lo)
            if lo < 0 or hi < lo:
                raise ValueError
            out.extend(range(lo, hi + 1))
    except ValueError:
        raise ConfigError(key, f"must look like '0' or '0-3,5', got {spec!r}") from None
    if len(set(out)) != len(out):
        raise ConfigError(key, f"names an index twice: {spec!r}")
    return out


def format_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6' (the inverse of `parse_indices`)."""
    parts, xs = [], sorted(indices)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def chip_bounds(res) -> Dict[int, str]:
    """TPU_CHIP_BOUNDS with the rows of `resources.tpu_chip_bounds` ("N:x,y,z N:x,y,z")."""
    key, table = "resources.tpu_chip_bounds", dict(TPU_CHIP_BOUNDS)
    for row in str(res.tpu_chip_bounds).split():
        n, _, dims = row.partition(":")
        try:
            n, xyz = int(n), [int(d) for d in dims.split(",")]
        except ValueError:
            raise ConfigError(key, f"rows look like '4:2,2,1', got {row!r}") from None
        if len(xyz) != 3 or min(xyz) < 1 or math.prod(xyz) != n:
            raise ConfigError(key, f"{row!r}: three sizes whose product is {n}")
        table[n] = ",".join(map(str, xyz))
    return table


# ============================================================================ the host

def detect_platform(environ: Mapping[str, str]) -> str:
    """'gpu' | 'tpu' | 'cpu' for this host without importing JAX (which would open devices):
    `JAX_PLATFORMS` first, then the device files of the NVIDIA and TPU drivers."""
    first = environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first in ("cuda", "gpu", "rocm"):
        return "gpu"
    if first in ("tpu", "cpu"):
        return first
    if _nvidia_devices():
        return "gpu"
    if _tpu_devices():
        return "tpu"
    return "cpu"


def detect_device_count(platform: str, environ: Mapping[str, str]) -> int:
    """Devices this host offers on `platform`; 0 = unknown (no limit is checked)."""
    if platform == "gpu":
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return len([d for d in visible.split(",") if d.strip()])
        return len(_nvidia_devices())
    if platform == "tpu":
        return len(_tpu_devices())
    return 0


def _nvidia_devices() -> List[str]:
    return [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]


def _tpu_devices() -> List[str]:
    accel = [p for p in glob.glob("/dev/accel*") if re.fullmatch(r"/dev/accel\d+", p)]
    if accel:  # TPU v2-v4
        return accel
    if importlib.util.find_spec("libtpu") is None:
        return []  # VFIO groups without libtpu are not TPU chips we can use
    return [p for p in glob.glob("/dev/vfio/*") if re.fullmatch(r"/dev/vfio/\d+", p)]  # v5+


def resolve_platform(platform: str, environ: Mapping[str, str]) -> str:
    return detect_platform(environ) if platform == "auto" else platform


def validate_resources(res, *, num_workers: int, sampler_kind: str, mesh_size: int,
                       environ: Mapping[str, str]) -> None:
    """`check_resources` on this host: 'auto' resolved, the device count stated or detected."""
    platform = resolve_platform(res.platform, environ)
    count = res.host_devices if isinstance(res.host_devices, int) and res.host_devices > 0 \
        else detect_device_count(platform, environ)
    check_resources(res, platform=platform, num_workers=num_workers, sampler_kind=sampler_kind,
                    mesh_size=mesh_size, host_devices=count)


# ============================================================================ the plan

def plan(res, *, num_workers: int, sampler_kind: str = "jax") -> Dict[str, Optional[List[int]]]:
    """{'learner': [...], 'worker0': [...], ..., 'evaluator': [...]}: each process's device
    indices (None = its environment is left as it is; the evaluator's None = placed as worker
    0). Raises ConfigError when the workers cannot split or share the sampler devices evenly."""
    learner = parse_indices(res.learner_devices, "resources.learner_devices") or None
    sampler = parse_indices(res.sampler_devices, "resources.sampler_devices")
    evaluator = parse_indices(res.evaluator_devices, "resources.evaluator_devices") or None
    out: Dict[str, Optional[List[int]]] = {"learner": learner}
    s, w = len(sampler), num_workers
    for i in range(w):
        if not sampler or sampler_kind != "jax":
            out[f"worker{i}"] = None
        elif s % w == 0:
            out[f"worker{i}"] = sampler[i * (s // w):(i + 1) * (s // w)]
        elif w % s == 0:
            out[f"worker{i}"] = [sampler[i % s]]
        else:
            raise ConfigError("rollout.num_workers", f"{w} workers can neither split nor share "
                              f"the {s} devices of resources.sampler_devices="
                              f"{res.sampler_devices!r} evenly (need {s} % {w} == 0 or "
                              f"{w} % {s} == 0)")
    out["evaluator"] = evaluator
    return out


def _key(name: str) -> str:
    """The config key that gives process `name` (of `plan`) its devices."""
    return {"learner": "resources.learner_devices",
            "evaluator": "resources.evaluator_devices"}.get(name, "resources.sampler_devices")


def check_resources(res, *, platform: str, num_workers: int, sampler_kind: str = "jax",
                    mesh_size: int = 1, host_devices: int = 0) -> None:
    """Raises ConfigError naming the key when the split cannot work on `platform` with
    `host_devices` devices (0 = unknown) and a learner mesh of `mesh_size` devices."""
    parse_indices(res.learner_cores, "resources.learner_cores")
    parse_indices(res.sampler_cores, "resources.sampler_cores")
    if res.platform not in PLATFORMS:
        raise ConfigError("resources.platform", f"must be one of {PLATFORMS}, "
                                                f"got {res.platform!r}")
    f = res.gpu_memory_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
        raise ConfigError("resources.gpu_memory_fraction", f"must be in [0, 1], got {f!r}")
    for key, lo in (("host_devices", 0), ("tpu_port", 1)):
        v = res[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"resources.{key}", f"must be an integer >= {lo}, got {v!r}")
    chip_bounds(res)
    if res.tpu_port + num_workers + 1 > 65535:
        raise ConfigError("resources.tpu_port", f"{res.tpu_port} + {num_workers} workers "
                                                "+ the evaluator runs past port 65535")
    procs = plan(res, num_workers=num_workers, sampler_kind=sampler_kind)
    learner = procs["learner"]
    if host_devices:
        for role in ("learner", "sampler", "evaluator"):
            over = [d for d in parse_indices(res[f"{role}_devices"], "") if d >= host_devices]
            if over:
                raise ConfigError(f"resources.{role}_devices", f"{res[f'{role}_devices']!r} "
                                  f"names device {over[0]} but this host has {host_devices} "
                                  f"{platform} devices (0-{host_devices - 1})")
    if learner is not None and mesh_size > len(learner):
        raise ConfigError("mesh.shape", f"needs {mesh_size} devices but "
                          f"resources.learner_devices={res.learner_devices!r} gives "
                          f"the learner {len(learner)}")
    if platform == "cpu":
        return  # virtual devices on shared cores: any split works
    if sampler_kind != "jax" and res.sampler_devices:
        raise ConfigError("resources.sampler_devices", "must be '' with sampler.kind="
                          f"{sampler_kind!r}: the servers' GPUs are given to "
                          "scripts/launch_sglang.py --gpus")
    if sampler_kind != "jax" and res.evaluator_devices:
        raise ConfigError("resources.evaluator_devices", "must be '' with sampler.kind="
                          f"{sampler_kind!r}: the evaluator samples from the servers of "
                          "sglang.eval_urls")
    if res.evaluator_devices and not res.learner_devices:
        raise ConfigError("resources.evaluator_devices", f"needs resources.learner_devices and "
                          f"resources.sampler_devices set too on {platform}: left '', the "
                          f"learner and the workers would open every {platform} device")
    if sampler_kind == "jax" and bool(res.learner_devices) != bool(res.sampler_devices):
        unset = "sampler" if res.learner_devices else "learner"
        raise ConfigError(f"resources.{unset}_devices", f"must be set too on {platform}: "
                          f"left '', the {unset} would open every {platform} device")
    users = Counter(d for devs in procs.values() if devs for d in devs)
    shared = {d: n for d, n in users.items() if n > 1}
    if platform == "tpu":
        bounds = chip_bounds(res)
        for name, chips in procs.items():
            if chips is None:
                continue
            key, n = _key(name), len(chips)
            if n not in bounds or chips != list(range(chips[0], chips[0] + n)) or chips[0] % n:
                raise ConfigError(key, f"gives {name} chips {format_indices(chips)}: a TPU "
                                  f"process needs an aligned block of {sorted(bounds)} "
                                  "consecutive chips (e.g. '0-3' or '4-7'; more sizes: "
                                  "resources.tpu_chip_bounds)")
        if shared:
            d = min(shared)
            key = "resources.evaluator_devices" if d in (procs["evaluator"] or ()) \
                else "resources.sampler_devices"
            raise ConfigError(key, f"TPU chip {d} would be opened by "
                              f"{shared[d]} processes (resources.learner_devices="
                              f"{res.learner_devices!r}, resources.sampler_devices="
                              f"{res.sampler_devices!r}, resources.evaluator_devices="
                              f"{res.evaluator_devices!r}, rollout.num_workers={num_workers}); "
                              "a chip belongs to one process")
    if platform == "gpu" and shared:
        d, n = max(shared.items(), key=lambda kv: kv[1])
        if not f:
            raise ConfigError("resources.gpu_memory_fraction", f"GPU {d} is shared by {n} "
                              f"processes (resources.learner_devices={res.learner_devices!r}, "
                              f"resources.sampler_devices={res.sampler_devices!r}): give each "
                              f"a memory fraction, e.g. {math.floor(90 / n) / 100}")
        if f * n > 1:
            raise ConfigError("resources.gpu_memory_fraction", f"{f} x {n} processes on "
                              f"GPU {d} exceeds its memory")


# ============================================================================ the child's env

def role_env(res, role: str, index: int = 0, *, num_workers: int = 1,
             sampler_kind: str = "jax", base: Optional[Mapping[str, str]] = None
             ) -> Dict[str, str]:
    """The environment of the child running `role` (`index`-th worker): `base` (None: empty)
    plus the platform variables of its devices. `res.platform` must be resolved (not 'auto').
    A pure function of its arguments; see the module docstring for what is set."""
    env = dict(base or {})
    platform = res.platform
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"resources.platform must be resolved first, got {platform!r}")
    procs = plan(res, num_workers=num_workers, sampler_kind=sampler_kind)
    role, index = placed_as(procs, role, index)
    name = {"learner": "learner", "sft": "learner", "worker": f"worker{index}",
            "evaluator": "evaluator"}.get(role)
    devices = procs.get(name) if name else None
    if devices is None:
        if role == "worker" and sampler_kind != "jax" and procs["learner"] and platform != "cpu":
            env["JAX_PLATFORMS"] = "cpu"  # an HTTP client: keep off the learner's devices
        return env
    if platform == "cpu":
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                       env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count="
                                             f"{len(devices)}"])
        env["JAX_PLATFORMS"] = "cpu"
    elif platform == "gpu":
        parent = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(parent[d] if parent else str(d) for d in devices)
        users = Counter(d for devs in procs.values() if devs for d in devs)
        if any(users[d] > 1 for d in devices):
            # JAX's "GPU memory allocation" page: several processes on one GPU each take
            # 75% unless given a fraction; preallocation off, the fraction caps the pool.
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(res.gpu_memory_fraction)
            env.pop("XLA_CLIENT_MEM_FRACTION", None)  # newer name; jaxlib rejects both set
    else:
        # Independent processes on one TPU host (github.com/jax-ml/jax
        # jax/_src/test_multiprocess.py, and Skye Wanderman-Milne's
        # gist.github.com/skye/f82ba45d2445bb19d53545538754f9a3, "Non-communicating
        # processes"): each is a one-process slice over its own chips, with its own port.
        port = {"learner": res.tpu_port,
                "evaluator": res.tpu_port + 1 + num_workers}.get(name, res.tpu_port + 1 + index)
        env.update({
            "TPU_VISIBLE_CHIPS": ",".join(map(str, devices)),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": chip_bounds(res)[len(devices)],
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
            "CLOUD_TPU_TASK_ID": "0",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # else libtpu's lockfile admits one process
        })
    return env


def role_cores(res, role: str, index: int = 0, *, num_workers: int = 1,
               sampler_kind: str = "jax") -> List[int]:
    """The cores `role` pins itself to ([] = none): `resources.{learner,sampler}_cores`, else
    on CPU its device indices; an evaluator with its own devices pins to those on CPU, and
    to none elsewhere. The SFT warm start and the queue are not pinned."""
    procs = plan(res, num_workers=num_workers, sampler_kind=sampler_kind)
    role, index = placed_as(procs, role, index)
    if role == "evaluator":
        return (procs["evaluator"] or []) if res.platform == "cpu" else []
    if role not in ("learner", "worker"):
        return []
    key = "learner_cores" if role == "learner" else "sampler_cores"
    cores = parse_indices(res[key], f"resources.{key}")
    if cores or res.platform != "cpu":
        return cores
    name = "learner" if role == "learner" else f"worker{index}"
    return procs[name] or []


def placed_as(procs: Mapping[str, Optional[List[int]]], role: str, index: int):
    """(role, index) whose cores and devices `role` gets: an evaluator without its own
    devices (`resources.evaluator_devices` = "") samples where the rollout workers do, on
    worker 0's."""
    if role == "evaluator" and not procs.get("evaluator"):
        return "worker", 0
    return role, index


def describe(res, *, num_workers: int, sampler_kind: str = "jax") -> str:
    """One line saying which devices each process gets (for the launcher's log)."""
    procs = plan(res, num_workers=num_workers, sampler_kind=sampler_kind)
    parts = [f"{name} {format_indices(devs)}" for name, devs in procs.items() if devs]
    return f"{res.platform} devices: " + (", ".join(parts) if parts else "default")
