"""One accelerator check of the whole project, for a borrowed GPU with no network (issue 14 §4).

    bash scripts/device_check.sh [--cpu | --tpu] [--out DIR] [--only model,engine,train]
    bash scripts/device_check.sh --tpu --only programs --config=configs/tpu/lora_v5e8.py

Runs, each as its own process with its own time limit (this driver never imports JAX, so
it holds no device memory):

  env     what is installed: each `install_requires` entry of setup.py against the installed
          version (missing or out of range is reported; off the CPU, a wheel carried in `.whl/`
          is installed for it with `pip --no-index --no-deps`), then a probe: JAX's backend,
          devices and device kind, and the project's modules imported (import errors named).
          Nothing is fetched. The project itself is not installed: every part imports it from
          the checkout through PYTHONPATH. (The editable install this part used to try,
          `pip install --no-deps --no-build-isolation --no-index -e .`, failed on the first
          H200 run: the image's setuptools `develop` re-runs `pip install -e . --use-pep517`,
          which needs the network; it was dropped rather than worked around.)
  (checkpoint)  before the model, lora and engine parts, when any of them runs: one random
          HF checkpoint of their model (the Qwen2.5-0.5B shape; `--cpu`: the tiny `--smoke`
          one), drawn on the host with NumPy by `python -m pipelinerl_jax.models.random_checkpoint`
          with JAX_PLATFORMS=cpu (nothing compiled, the accelerator untouched), its own step
          with its own limit, reported as `checkpoint` (time, bytes); each of those parts gets
          it as `--checkpoint`. Why: the benchmarks used to build the weights with one jitted
          init of the whole model, which XLA took over 3 minutes to compile on the H200, so
          every 0.5B part timed out making random weights (BENCHMARKS.md, "First accelerator
          run"). Should the step fail, each part writes its own, the same host-side way. (The
          paged part's tiny model is not this checkpoint: it draws its weights in-process
          with the same NumPy code, `random_checkpoint.random_params`.)
  model   scripts/bench_real_size.py --only learner: the train step on the Qwen2.5-0.5B shape
          (bf16 compute), MFU against the bf16 matmul peak measured in the same process.
  lora    scripts/bench_lora.py: full fine-tuning vs LoRA (rank 16, every projection) on the
          Qwen2.5-0.5B shape: bytes per published version and learner state (exact, from
          shapes), the train step (compile apart) and publication over the weight stream.
  engine  scripts/bench_real_size.py --only engine --kv-layout both: JaxEngine decode tokens/s
          at batch 1/8/32 against the bandwidth and compute rooflines measured in the same
          process, for the dense and (not on CPU) the paged KV cache (paged attention through
          `engine.attention_kernel=auto`: the Pallas kernel on a GPU/TPU), and paged's share
          of the roofline over dense's (`paged_vs_dense_of_roofline`: the median of the
          per-round ratios of the two engines timed interleaved, each round's in
          `paged_vs_dense_rounds`, their min / max in `paged_vs_dense_range`).
  paged   scripts/bench_paged.py: dense vs paged KV cache at the same KV bytes under the
          sampler-bound length tail (active sequences per step, tokens/s, preemptions,
          greedy tokens equal); on GPU its --quick size (128 sequences), on CPU --smoke.
  train   experiments/train.py --config=configs/default.py for 20 RL steps (a 30-step warm
          start), learner and sampler sharing GPU 0 through `resources.learner_devices=0`,
          `resources.sampler_devices=0`, `resources.gpu_memory_fraction` (preallocation off).

  programs  (only with --only programs) scripts/run_programs.py --config=...: the programs
          experiments/compile_check.py compiles for a TPU topology, compiled for this host's
          devices and run on zero-filled inputs of the run's shapes; measured time and peak
          memory beside the compiler's roofline and plan (docs/tpu.md). `--tpu` runs JAX on
          a TPU VM's chips (JAX_PLATFORMS=tpu).

`--cpu`: the same parts with JAX on CPU, the tiny model (`--smoke`) and 3 RL steps, no
installation (the test suite runs this). The benchmark parts write timestamped progress lines
(checkpoint loaded, peaks measured, compile done, each timed phase) to stderr, i.e. their
log, so a part killed at its limit still says where it was. Each part's output goes to
`<out>/<part>.log` (`<out>` = --out, else $OUT, else a temporary folder); run directories go
under --workdir. The last line printed is one JSON object with every figure and, per part
(and the checkpoint step), `status` ('ok', 'failed', 'timeout', 'skipped') and `error` (the
log's tail), so a partial failure still yields the other figures; it is also written to
`<out>/device_check.json`. Exit status 0 when every part ran ok, 1 otherwise.

Carrying missing wheels (the machine has no network): where pip works, run
`bash scripts/device_check.sh --download-wheels` once; it fills `.whl/` (ignored by git) with
the pure-python and cp312 wheels of the requirements an accelerator image may lack or hold
in another version, and the run tool carries `.whl` (see the header of device_check.sh).
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(ROOT, ".whl")
PARTS = ("env", "model", "lora", "engine", "paged", "train")
# Run only when named in --only: the programs of --config that experiments/compile_check.py
# compiles for a TPU topology, run here for real (scripts/run_programs.py; docs/tpu.md).
OPTIONAL = ("programs",)
# Seconds per part (a part is stopped GRACE_S before its limit); the GPU total stays under 10
# minutes with room for process start-up: the GPU limits sum to TOTAL_S. The checkpoint step's
# 45 s (24-27 s for the 0.5B shape on this 2-core VM, mostly drawing normals, which it spreads
# over a bigger host's cores) came from env -5 (it no longer tries the editable install),
# model -10, lora -10, engine -10 and paged -10; train keeps its 140 (107.6 s on the H200).
LIMITS = {"gpu": {"env": 35, "checkpoint": 45, "model": 115, "lora": 80, "engine": 95,
                  "paged": 65, "train": 140},
          "cpu": {"env": 60, "checkpoint": 90, "model": 180, "lora": 240, "engine": 120,
                  "paged": 180, "train": 300}}
# The parts that load the random checkpoint (the benchmark scripts' `--checkpoint`).
CHECKPOINT_PARTS = ("model", "lora", "engine")
PROGRAMS_LIMIT_S = 540
TOTAL_S = {"gpu": 575, "cpu": 1320}
GRACE_S = 20  # of a part's limit, between SIGTERM and SIGKILL
# Distributions whose wheels `--download-wheels` fetches: the accelerator image (KINDS.md)
# lacks the first two; the others it has, perhaps in a version outside setup.py's range.
# JAX, numpy, transformers & co. are the image's own and never replaced.
CARRIED = ("ml-collections", "grpcio-health-checking", "grpcio", "protobuf",
           "flax", "optax", "orbax-checkpoint")
TRAIN_STEPS = {"gpu": 20, "cpu": 3}


def requirements() -> list:
    """setup.py's `install_requires` strings (read, not executed)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]
    return []


def check_requirements() -> dict:
    """{name: {"want": spec, "have": version | None, "ok": bool | None}} (None: unknown)."""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no packaging: versions are reported, not checked
        Requirement = None
    out = {}
    for spec in requirements():
        name = re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        ok = None if Requirement is None else (
            have is not None and Requirement(spec).specifier.contains(have, prereleases=True))
        out[name] = {"want": spec[len(name):], "have": have, "ok": ok}
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def carried_wheels(names) -> list:
    """Wheel files in `.whl/` for the distributions `names`."""
    want = {_norm(n) for n in names}
    return sorted(w for w in glob.glob(os.path.join(WHEELS, "*.whl"))
                  if _norm(os.path.basename(w).split("-")[0]) in want)


def download_wheels() -> int:
    """Fills `.whl/` with the wheels of CARRIED at this environment's versions (needs pip and
    the network; run where both are)."""
    from importlib import metadata
    os.makedirs(WHEELS, exist_ok=True)
    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + \
        ["--platform=manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version=3.12", "--implementation=cp", *platforms, "-d", WHEELS, *pins]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


class Runner:
    """Runs the parts as subprocesses under one overall deadline, logging to `out`."""

    def __init__(self, out: str, mode: str, env: dict):
        self.out, self.mode, self.env = out, mode, env
        self.deadline = time.monotonic() + TOTAL_S[mode]

    def run(self, part: str, cmd: list, limit: float, env: dict | None = None) -> dict:
        """{"status", "rc", "time_s", "stdout" (text), "error"?}; output also in the log.
        `env`: variables that replace the parts' own for this command."""
        limit = min(limit, self.deadline - time.monotonic())
        if limit < 10:
            return {"status": "skipped", "error": "no time left in the overall budget"}
        log = os.path.join(self.out, f"{part}.log")
        t = time.monotonic()
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, **(env or {})},
                                    stdout=subprocess.PIPE,
                                    stderr=f, text=True, start_new_session=True)
            try:
                stdout, _ = proc.communicate(timeout=max(limit - GRACE_S, 1))
                status = "ok" if proc.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                # SIGTERM first: the launcher then stops its children (own sessions) itself
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    stdout, _ = proc.communicate(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    stdout, _ = proc.communicate()
                status = "timeout"
            f.write(stdout)
        res = {"status": status, "rc": proc.returncode, "time_s": round(time.monotonic() - t, 1),
               "stdout": stdout}
        if status != "ok":
            res["error"] = _tail(log)
        return res


def _tail(path: str, n: int = 1500) -> str:
    with open(path, errors="replace") as f:
        text = f.read()
    return text[-n:]


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


PROBE = """
import importlib, json
out, errors = {}, {}
try:
    import jax, jaxlib
    d = jax.devices()
    out.update(backend=jax.default_backend(), devices=len(d), device_kind=d[0].device_kind,
               jax=jax.__version__, jaxlib=jaxlib.__version__)
except Exception as e:
    errors["jax"] = f"{type(e).__name__}: {e}"[:400]
for m in MODULES:
    try:
        importlib.import_module(m)
    except Exception as e:
        errors[m] = f"{type(e).__name__}: {e}"[:400]
out["import_errors"] = errors
print(json.dumps(out))
"""
# What the parts import: an import-time failure (a gencode/protobuf mismatch, a flax API
# change) shows up here, named, before the parts run.
MODULES = ("pipelinerl_jax.learner.loop", "pipelinerl_jax.rollout.jax_engine",
           "pipelinerl_jax.transport.queue_server", "pipelinerl_jax.launch", "ml_collections",
           "pipelinerl_jax.metrics")
SITE = os.path.join(tempfile.gettempdir(), "device_check_site")


def install_wheels(r: Runner, wheels: list) -> str:
    """pip-installs carried wheels offline into this Python's environment, or where that is
    not writable into SITE (then put first on every part's PYTHONPATH)."""
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            "--no-compile"]
    if r.run("env", base + wheels, 120)["status"] == "ok":
        return "ok"
    res = r.run("env", base + ["--target", SITE, "--upgrade"] + wheels, 120)
    if res["status"] == "ok":
        r.env["PYTHONPATH"] = os.pathsep.join([SITE, r.env["PYTHONPATH"]])
        sys.path.insert(0, SITE)
        return "ok (--target " + SITE + ")"
    return "failed"


def part_env(r: Runner, install: bool) -> dict:
    out = {"python": sys.version.split()[0], "executable": sys.executable}
    reqs = check_requirements()
    if install:
        wheels = carried_wheels([n for n, v in reqs.items() if v["ok"] is False])
        if wheels:
            out["carried_wheels"] = [os.path.basename(w) for w in wheels]
            out["carried_status"] = install_wheels(r, wheels)
            reqs = check_requirements()
    out["requirements_unmet"] = {n: v for n, v in reqs.items() if v["ok"] is False}
    out["versions"] = {n: v["have"] for n, v in reqs.items()}
    res = r.run("env", [sys.executable, "-c", f"MODULES = {MODULES!r}\n" + PROBE],
                LIMITS[r.mode]["env"])
    out.update(_last_json(res["stdout"]) or {})
    missing = [n for n, v in reqs.items() if v["have"] is None]
    problems = []
    if missing:
        problems.append(f"not installed: {', '.join(missing)}; carry their wheels in .whl/ "
                        "(bash scripts/device_check.sh --download-wheels where pip works)")
    if out.get("import_errors"):
        problems.append(f"import errors: {out['import_errors']}")
    if res["status"] != "ok":
        problems.append(res["error"])
    out["status"] = "failed" if problems else "ok"
    if problems:
        out["error"] = "; ".join(problems)
    return out


def part_checkpoint(r: Runner, workdir: str) -> dict:
    """The random checkpoint the model, lora and engine parts load, written host-side."""
    path = os.path.join(workdir, "random-checkpoint")
    cmd = [sys.executable, "-m", "pipelinerl_jax.models.random_checkpoint", f"--out={path}",
           "--shape=" + ("tiny-qwen2" if r.mode == "cpu" else "qwen2.5-0.5b")]
    # JAX on the CPU whatever the parts use: this step never touches the accelerator
    res = r.run("checkpoint", cmd, LIMITS[r.mode]["checkpoint"], env={"JAX_PLATFORMS": "cpu"})
    data = _last_json(res["stdout"]) or {}
    out = {"status": res["status"], "time_s": res.get("time_s"), **data}
    if "error" in res:
        out["error"] = res["error"]
    elif not os.path.isfile(os.path.join(path, "config.json")):
        out.update(status="failed", error=f"no checkpoint at {path}")
    return out


def _checkpoint_arg(checkpoint: dict | None) -> list:
    """`--checkpoint=...` when the checkpoint step wrote one (else the bench writes its own)."""
    if checkpoint and checkpoint.get("status") == "ok":
        return [f"--checkpoint={checkpoint['path']}"]
    return []


def part_bench(r: Runner, part: str, workdir: str, param_dtype: str,
               checkpoint: dict | None = None) -> dict:
    cmd = [sys.executable, "scripts/bench_real_size.py", "--only",
           "learner" if part == "model" else "engine", f"--workdir={workdir}",
           f"--param-dtype={param_dtype}", *_checkpoint_arg(checkpoint)]
    if part == "engine" and r.mode != "cpu":  # on CPU the paged part covers the paged engine
        # two interleaved rounds (each round is one more generate per layout and batch; the
        # part's time limit is fixed within the check's total)
        cmd += ["--kv-layout=both", "--repeats=2"]
    if r.mode == "cpu":
        cmd.append("--smoke")
    res = r.run(part, cmd, LIMITS[r.mode][part])
    data = _last_json(res["stdout"]) or {}
    out = {"status": res["status"], "time_s": res.get("time_s")}
    if "error" in res:
        out["error"] = res["error"]
    for k in ("model", "params", "devices", "device_kind", "peaks", "checkpoint",
              "checkpoint_write_s"):
        if k in data:
            out[k] = data[k]
    out.update(data.get("learner" if part == "model" else "engine", {}))
    if part == "engine":
        for k in ("engine_paged", "paged_vs_dense_of_roofline", "paged_vs_dense_rounds",
                  "paged_vs_dense_range"):
            if k in data:
                out[k.replace("engine_", "")] = data[k]
    return out


def part_programs(r: Runner, config: str) -> dict:
    res = r.run("programs", [sys.executable, "scripts/run_programs.py", f"--config={config}"],
                PROGRAMS_LIMIT_S)
    data = _last_json(res["stdout"]) or {}
    out = {"status": res["status"], "time_s": res.get("time_s"), "config": config, **data}
    if "error" in res:
        out["error"] = res["error"]
    failed = [k for k, v in data.get("programs", {}).items() if "error" in v]
    if out["status"] == "ok" and (failed or not data):
        out.update(status="failed", error=f"programs that did not run: {failed or 'all'}")
    return out


def part_paged(r: Runner) -> dict:
    cmd = [sys.executable, "scripts/bench_paged.py", "--smoke" if r.mode == "cpu" else "--quick"]
    res = r.run("paged", cmd, LIMITS[r.mode]["paged"])
    data = _last_json(res["stdout"]) or {}
    out = {"status": res["status"], "time_s": res.get("time_s")}
    if "error" in res:
        out["error"] = res["error"]
    for k in ("sequences", "kv_tokens", "active_ratio_vs_dense", "p50_active_ratio_vs_dense",
              "tokens_per_s_ratio_vs_dense", "greedy_tokens_identical", "prefills_per_group",
              "multiturn_prefill_ratio", "multiturn_tokens_identical"):
        if k in data:
            out[k] = data[k]
    main = data.get("scenarios", {}).get("sampler_bound", {})
    for layout in ("dense", "paged"):
        for k in ("mean_active", "tokens_per_s", "preemptions_per_1000"):
            if k in main.get(layout, {}):
                out[f"{layout}_{k}"] = main[layout][k]
    return out


def part_lora(r: Runner, checkpoint: dict | None = None) -> dict:
    cmd = [sys.executable, "scripts/bench_lora.py", *_checkpoint_arg(checkpoint)] + (
        ["--smoke"] if r.mode == "cpu" else [])
    res = r.run("lora", cmd, LIMITS[r.mode]["lora"])
    data = _last_json(res["stdout"]) or {}
    out = {"status": res["status"], "time_s": res.get("time_s")}
    if "error" in res:
        out["error"] = res["error"]
    for k in ("model", "rank", "publish_bytes_ratio", "learner_state_bytes_ratio",
              "checkpoint"):
        if k in data:
            out[k] = data[k]
    timed = data.get("timed") or {}
    for k in ("layers", "step_s_ratio", "publish_s_ratio"):
        if k in timed:
            out[k] = timed[k]
    for kind in ("full", "lora"):
        for k in ("compile_s", "step_s", "publish_s"):
            if k in timed.get(kind, {}):
                out[f"{kind}_{k}"] = timed[kind][k]
    return out


def train_overrides(mode: str, steps: int) -> list:
    o = {"learner.total_steps": steps, "learner.eval_every": steps,
         "learner.checkpoint_every": steps, "resources.learner_devices": "0"}
    if mode == "gpu":
        o.update({"warm_start.steps": 30, "learner.eval_size": 64,
                  "resources.platform": "gpu", "resources.sampler_devices": "0",
                  "resources.gpu_memory_fraction": 0.4,
                  "resources.learner_cores": "", "resources.sampler_cores": ""})
    else:  # one virtual device and one core each (the config pins cores 0 and 1)
        o.update({"warm_start.steps": 5, "learner.eval_size": 8, "learner.batch_groups": 2,
                  "rollout.group_size": 4, "engine.max_slots": 16,
                  "resources.platform": "cpu", "resources.sampler_devices": "1"})
    return [f"--config.{k}={v}" for k, v in o.items()]


def _jsonl(path: str) -> list:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:  # a line cut short by a killed process
                    pass
    return rows


def part_train(r: Runner, workdir: str, steps: int) -> dict:
    run_dir = os.path.join(workdir, "train")
    cmd = [sys.executable, "experiments/train.py", "--config=configs/default.py",
           f"--workdir={run_dir}", *train_overrides(r.mode, steps)]
    res = r.run("train", cmd, LIMITS[r.mode]["train"])
    out = {"status": res["status"], "time_s": res.get("time_s"), "steps_wanted": steps}
    if "error" in res:
        out["error"] = res["error"]
    rows = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train_rows = [x for x in rows if "learner/step_time_s" in x]

    def med(key):
        vals = [x[key] for x in train_rows[1:] or train_rows  # the first step compiles
                if isinstance(x.get(key), (int, float))]
        return round(statistics.median(vals), 4) if vals else None

    evals = [x["eval/accuracy"] for x in _jsonl(os.path.join(run_dir, "eval.jsonl"))
             if "eval/accuracy" in x]  # the evaluator role's records, in version order
    out.update({"steps": max((x.get("step", 0) for x in train_rows), default=0),
                "wall_time_s": round(train_rows[-1]["wall_time_s"], 1) if train_rows else None,
                "step_time_s": med("learner/step_time_s"),
                "wait_time_s": med("learner/wait_time_s"),
                "tokens_per_s": med("learner/tokens_per_s"),
                "weight_sync_s": med("weight_sync/time_s"),
                "sampler_tokens_per_s": med("sampler/tokens_per_s"),
                "reward_mean_last": train_rows[-1].get("reward/mean") if train_rows else None,
                "eval_accuracy_last": evals[-1] if evals else None})
    if out["status"] == "ok" and out["steps"] < steps:
        out.update(status="failed", error=f"{out['steps']} of {steps} steps in metrics.jsonl")
    return out


def _guarded(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the JSON line must still come out
        return {"status": "failed", "error": f"driver: {type(e).__name__}: {e}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="JAX on CPU, tiny shapes, few steps")
    p.add_argument("--tpu", action="store_true", help="JAX on the TPU chips of this VM")
    p.add_argument("--config", default="configs/default.py",
                   help="the run config whose programs the 'programs' part runs")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="logs and device_check.json (default $OUT)")
    p.add_argument("--workdir", default=None, help="checkpoints and run dirs (default: tmp)")
    p.add_argument("--only", default=",".join(PARTS), help="comma-separated parts")
    p.add_argument("--steps", type=int, default=None, help="RL steps of the train part")
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model part's learner parameter dtype (compute is bf16 off-CPU)")
    p.add_argument("--no-install", action="store_true", help="skip the pip installs")
    p.add_argument("--download-wheels", action="store_true",
                   help="fill .whl/ with the wheels to carry, then exit (needs the network)")
    a = p.parse_args(argv)
    if a.download_wheels:
        return download_wheels()
    mode = "cpu" if a.cpu else "gpu"
    out = a.out or tempfile.mkdtemp(prefix="device_check_")
    os.makedirs(out, exist_ok=True)
    workdir = a.workdir or tempfile.mkdtemp(prefix="device_check_work_")
    only = [s for s in a.only.split(",") if s]
    unknown = set(only) - set(PARTS + OPTIONAL)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; valid: {PARTS + OPTIONAL}")

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    if mode == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:  # fail loudly rather than fall back to CPU
        env.setdefault("JAX_PLATFORMS", "tpu" if a.tpu else "cuda")
    env.pop("XLA_FLAGS", None)  # bench_real_size and the launcher set their own
    r = Runner(out, mode, env)
    t0 = time.monotonic()
    result = {"device_check": 1, "mode": mode}
    parts = {"env": lambda: part_env(r, install=mode != "cpu" and not a.no_install),
             "model": lambda: part_bench(r, "model", bench_dir, a.param_dtype,
                                         result.get("checkpoint")),
             "lora": lambda: part_lora(r, result.get("checkpoint")),
             "engine": lambda: part_bench(r, "engine", bench_dir, a.param_dtype,
                                          result.get("checkpoint")),
             "paged": lambda: part_paged(r),
             "train": lambda: part_train(r, workdir, a.steps or TRAIN_STEPS[mode]),
             "programs": lambda: part_programs(r, a.config)}
    bench_dir = os.path.join(workdir, "bench")
    for part in PARTS + OPTIONAL:
        if part in only:
            if part in CHECKPOINT_PARTS and "checkpoint" not in result:  # once, before them
                result["checkpoint"] = _guarded(lambda: part_checkpoint(r, bench_dir))
            result[part] = _guarded(parts[part])
    steps = only + (["checkpoint"] if "checkpoint" in result else [])
    result["ok"] = all(result[k]["status"] == "ok" for k in steps)
    result["time_s"] = round(time.monotonic() - t0, 1)
    line = json.dumps(result)
    with open(os.path.join(out, "device_check.json"), "w") as f:
        f.write(line + "\n")
    print(line, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
