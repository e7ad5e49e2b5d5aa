"""Runs an ablation grid: one shared warm start, then every run, resumably, a few at a time.

    runs = grid.expand(config)
    run_grid(config, workdir)     # what experiments/ablate.py calls

Layout of WORKDIR:
    ablation.json                 the ablation config as given
    warm_start/model              the shared SFT checkpoint (unless experiment.warm_start.checkpoint;
                                  launch/warm_start.py, the same warm start as a single run's)
    runs/<run>/spec.json          name, labels, cell and full experiment config of the run
    runs/<run>/status.json        done | diverged | failed, attempts, seconds, cores
    runs/<run>/ablate.log         the run's launcher output
    runs/<run>/...                the run directory (docs/metrics.md)
    results.csv, runs.csv, cells.csv, summary.json   (results.write_tables)
    xla_cache/                    XLA's persistent compilation cache, shared by every run

A run is a child process (`python -m pipelinerl_jax.ablation.runner run DIR`) calling
`launch.launch(config, DIR)`; its launcher starts the queue, learner and worker processes as
in `experiments/train.py`, each process supervised by `launch/supervisor.py`. A run is
`diverged` when its learner left a `learner_stopped` record with reason `diverged` in the
run's `events.jsonl` (launch/outcome.py: it stopped on non-finite steps, a result in itself).
Resuming: a run whose status is `done` or `diverged` is skipped (so is one found finished in
the committed tables of `runner.finished_tables`, whose config columns must agree); a run interrupted after a
committed checkpoint restarts in place and its learner resumes from that checkpoint; one
interrupted before any checkpoint is wiped and restarted; a `failed` one is retried. A
finished run whose config differs from this grid's on a key both hold is refused (ConfigError),
never skipped: its result is another grid's.

Parallel runs: with `runner.parallel = n > 1` and `runner.pin`, the available cores are split
into n sets and every process of run slot i (learner and sampler alike) is pinned to set i.
That is how lag-injected runs should go (they are lock-step: learner and sampler alternate,
so one core per run loses little, and n runs keep n cores busy). Wall-clock comparisons of
sync vs async must not be pinned that way: give them `parallel = 1`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import List, Optional

import ml_collections

from pipelinerl_jax import run_config
from pipelinerl_jax.ablation import results
from pipelinerl_jax.ablation.grid import RunSpec, axis_labels, expand
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.launch import launch, outcome
from pipelinerl_jax.launch.supervisor import Child, exit_now, tail, wait_any
from pipelinerl_jax.launch.warm_start import warm_start
from pipelinerl_jax.provenance import provenance

FINAL = ("done", "diverged")
STOP_GRACE_S = 60.0  # a run's launcher stops its own children within their timeouts


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def run_status(run_dir: str) -> str:
    """'new' | 'partial' | 'done' | 'diverged' | 'failed' of a run directory."""
    st = _read_json(os.path.join(run_dir, "status.json"))
    if st and st.get("status") in FINAL + ("failed",):
        return st["status"]
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) or \
            os.path.isdir(os.path.join(run_dir, "checkpoints")):
        return "partial"
    return "new"


def committed_checkpoints(run_dir: str) -> List[int]:
    """Steps with a committed learner checkpoint (`learner.checkpoint.committed_steps`)."""
    from pipelinerl_jax.learner.checkpoint import committed_steps  # heavy: orbax, JAX
    return committed_steps(os.path.join(run_dir, "checkpoints"))


def split_cores(cores: List[int], n: int) -> List[str]:
    """n disjoint core-set specs ("0", "1" or "0-1", "2-3"); fewer cores than n: round-robin."""
    if not cores:
        return [""] * n
    if len(cores) < n:
        return [str(cores[i % len(cores)]) for i in range(n)]
    per = len(cores) // n
    return [",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(n)]


def available_cores(spec: str) -> List[int]:
    if spec:
        return run_config.parse_cores(spec, "runner.cores")
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


# ============================================================================ the grid

def _env(c, workdir: str) -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.pop("XLA_FLAGS", None)  # one CPU device per process, as in a real run
    cache = c.runner.compilation_cache
    if cache:
        # XLA's persistent compilation cache: every run of a grid compiles the same train
        # step, decode step and evaluator; with the cache only the first run pays for it.
        path = os.path.join(workdir, "xla_cache") if cache == "auto" else cache
        env["PIPELINERL_JAX_CACHE"] = os.path.abspath(path)  # read by compile_cache.enable()
    else:
        env["PIPELINERL_JAX_CACHE"] = "off"
    return env


RUN_MODES = ("pipeline", "inprocess")


def check_mode(mode: str) -> str:
    """`runner.mode`: 'pipeline' (every run a launch of separate processes, as a real run) or
    'inprocess' (a lag-injected run in one process, `launch/inprocess.py`)."""
    if mode not in RUN_MODES:
        raise ConfigError("runner.mode", f"unknown {mode!r}; valid: {RUN_MODES}")
    return mode


def run_child(run_dir: str, env: dict, mode: str = "pipeline") -> Child:
    """The started process of one run (`python -m pipelinerl_jax.ablation.runner MODE DIR`),
    its output in `run_dir/ablate.log`; SIGTERM makes it stop the run in order."""
    return Child("run", [sys.executable, "-m", "pipelinerl_jax.ablation.runner", mode, run_dir],
                 os.path.join(run_dir, "ablate.log"), env=env).start()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_conflicts(old: dict, new: dict) -> List[str]:
    """Keys both experiment configs (JSON form) hold with different values. A key only one
    holds is a code version's new (or retired) option at its default, not a conflict: a grid
    resumed after an upgrade keeps its finished runs."""
    a, b = _flat(old), _flat(new)
    return sorted(k for k in a.keys() & b.keys() if a[k] != b[k])


def prepare_run(run: RunSpec, run_dir: str) -> str:
    """Makes `run_dir` ready to (re)start `run`; returns 'skip', 'resume' or 'start'."""
    status = run_status(run_dir)
    if status in FINAL:
        return "skip"
    os.makedirs(run_dir, exist_ok=True)
    spec = json.loads(json.dumps({"name": run.name, "labels": run.labels, "cell": run.cell,
                                  "experiment": run.config.to_dict()}))
    old = _read_json(os.path.join(run_dir, "spec.json"))
    if old is not None and config_conflicts(old.get("experiment") or {}, spec["experiment"]):
        # The grid's config changed under this run: its partial results are not this run's.
        status = "changed"
    if status in ("partial", "failed") and committed_checkpoints(run_dir):
        _write_json(os.path.join(run_dir, "spec.json"), spec)
        return "resume"
    for name in os.listdir(run_dir):  # nothing durable to resume from: start clean
        path = os.path.join(run_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    _write_json(os.path.join(run_dir, "spec.json"), spec)
    return "start"


def _stop_on_sigterm() -> None:
    """SIGTERM (a `kill`, a batch system's stop) unwinds like Ctrl-C, so the runs in flight
    (their own process groups) are stopped, not orphaned."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def replicate_major(c: ml_collections.ConfigDict, runs: List[RunSpec]) -> List[RunSpec]:
    """The runs with the seed axis varying slowest: a grid stopped part-way (it takes hours)
    holds whole replicates of every cell rather than every seed of a few cells."""
    if not c.seed_axis or c.seed_axis not in c.axes:
        return list(runs)
    order = axis_labels(c.seed_axis, c.axes[c.seed_axis])
    return sorted(runs, key=lambda r: order.index(r.labels[c.seed_axis]))  # stable


def finished_in_tables(folders: str) -> dict:
    """{run name: its runs.csv row} of the finished runs in committed-table folders."""
    import csv
    out = {}
    for folder in [f.strip() for f in str(folders or "").split(",") if f.strip()]:
        path = os.path.join(folder, "runs.csv")
        if not os.path.isfile(path):
            raise ConfigError("runner.finished_tables", f"{folder!r} holds no runs.csv")
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("status") in FINAL:
                    out[row["run"]] = row
    return out


def table_conflicts(row: dict, cfg: dict) -> List[str]:
    """Config columns of a committed run row that disagree with the run config `cfg`."""
    clash = []
    for column, key in results.CONFIG_COLUMNS.items():
        want, got = results.config_value(cfg, key), row.get(column, "")
        if got in ("", None) or want is None:
            continue
        try:
            same = float(got) == float(want)
        except (TypeError, ValueError):
            same = str(got) == str(want)
        if not same:
            clash.append(f"{column}: table {got!r} vs grid {want!r}")
    return clash


def run_grid(c: ml_collections.ConfigDict, workdir: str, log=print,
             runs: Optional[List[RunSpec]] = None) -> dict:
    """Runs every unfinished run of the grid `c` under `workdir`, then writes the tables.

    Returns {"runs": n, "ran": [...], "skipped": [...], "failed": [...], "wall_s": s,
    "warmup_s": s (of it, the compile warm-up's)}."""
    workdir = os.path.abspath(workdir)
    mode = check_mode(c.runner.get("mode", "pipeline"))
    runs = runs if runs is not None else expand(c)
    if mode == "inprocess":  # every run checked before anything starts
        from pipelinerl_jax.launch.inprocess import check_inprocess
        for r in runs:
            check_inprocess(run_config.resolve(ml_collections.ConfigDict(r.config.to_dict())))
    os.makedirs(os.path.join(workdir, "runs"), exist_ok=True)
    runs = replicate_major(c, runs)
    _write_json(os.path.join(workdir, "ablation.json"), json.loads(c.to_json_best_effort()))
    t_start = time.time()
    todo = []
    skipped = []
    committed = finished_in_tables(c.runner.get("finished_tables", ""))
    for r in runs:
        run_dir = os.path.join(workdir, "runs", r.dirname)
        if r.name in committed and run_status(run_dir) not in FINAL:
            clash = table_conflicts(committed[r.name], json.loads(json.dumps(r.config.to_dict())))
            if clash:
                raise ConfigError("runner.finished_tables",
                                  f"run {r.name} is in the committed tables with another config "
                                  f"({'; '.join(clash[:5])})")
            skipped.append(r.name)
        elif run_status(run_dir) in FINAL:
            old = (_read_json(os.path.join(run_dir, "spec.json")) or {}).get("experiment") or {}
            clash = config_conflicts(old, json.loads(json.dumps(r.config.to_dict())))
            if clash:  # another grid's run under this name: never pass its result off as this one's
                raise ConfigError("axes", f"run {r.name} in {workdir} finished with a different "
                                          f"config ({', '.join(clash[:5])}); give this grid's "
                                          f"run another label or another workdir")
            skipped.append(r.name)
        else:
            todo.append(r)
    log(f"{len(runs)} runs: {len(skipped)} already finished, {len(todo)} to run "
        f"({c.runner.parallel} at a time)")
    ran, failed, warmup_s = [], [], 0.0
    if todo:
        _stop_on_sigterm()
        env = _env(c, workdir)
        exp = ml_collections.ConfigDict(c.experiment.to_dict())
        run_config.validate(exp)
        ckpt = warm_start(run_config.resolve(exp), workdir, progress=False, env=env,
                          timeout_s=c.runner.warm_start_timeout_s, log=log)
        if c.runner.warmup_steps and env.get("PIPELINERL_JAX_CACHE") != "off":
            warmup_s = _warmup(c, workdir, todo[0], ckpt, env, log)
        slots = split_cores(available_cores(c.runner.cores), c.runner.parallel) \
            if c.runner.parallel > 1 and c.runner.pin else [None] * c.runner.parallel
        free = list(range(c.runner.parallel))
        active = {}  # slot -> (RunSpec, run dir, Child, mode)
        queue = list(todo)
        try:
            while queue or active:
                while queue and free:
                    r = queue.pop(0)
                    slot = free.pop(0)
                    run_dir = os.path.join(workdir, "runs", r.dirname)
                    how = prepare_run(r, run_dir)
                    cfg = ml_collections.ConfigDict(r.config.to_dict())
                    cfg.warm_start.checkpoint = ckpt
                    if slots[slot] is not None:
                        cfg.resources.learner_cores = slots[slot]
                        cfg.resources.sampler_cores = slots[slot]
                    _write_json(os.path.join(run_dir, "launch_config.json"), cfg.to_dict())
                    active[slot] = (r, run_dir, run_child(run_dir, env, mode), how)
                    log(f"  {how:6s} {r.name}" + (f"  [cores {slots[slot]}]" if slots[slot] else ""))
                wait_any([p for _, _, p, _ in active.values()], 1.0)  # wakes on an exit
                for slot, (r, run_dir, p, how) in list(active.items()):
                    code = p.poll()
                    if code is None and time.time() - p.started_at > c.runner.run_timeout_s:
                        p.stop(STOP_GRACE_S)
                        code = -1
                    if code is None:
                        continue
                    status = _finish(run_dir, p, code, slots[slot], how, mode)
                    (ran if status in FINAL else failed).append(r.name)
                    log(f"  {status:8s} {r.name} in {time.time() - p.started_at:.0f} s"
                        + _brief(run_dir))
                    del active[slot]
                    free.append(slot)
        except BaseException:
            log(f"stopping {len(active)} run(s); re-run the same command to resume")
            for _, _, p, _ in active.values():
                p.stop(STOP_GRACE_S)
            raise
    tables = results.write_tables(workdir, c.analysis)
    out = {"runs": len(runs), "ran": ran, "skipped": skipped, "failed": failed,
           "wall_s": time.time() - t_start, "warmup_s": warmup_s, **tables}
    _write_json(os.path.join(workdir, "grid_run.json"), out)
    return out


def warmup(cfg: ml_collections.ConfigDict, directory: str, steps: int, env: dict,
           timeout_s: float = 3600.0, mode: str = "pipeline") -> dict:
    """A throwaway run of `steps` learner steps of experiment `cfg` in `directory`, so that
    XLA's persistent cache (`env`'s PIPELINERL_JAX_CACHE) holds its compiled programs (train
    step buckets, engine and evaluator) before any timed run: otherwise the first run of a
    wall-clock comparison is charged tens of seconds of compiling the others are not.
    Returns {"steps", "wall_s", "exit_code"}; skipped (wall_s 0) when `directory` holds a
    finished warm-up. Shared by the grid runner and the benchmarks."""
    if os.path.exists(os.path.join(directory, "summary.json")):
        return {"steps": steps, "wall_s": 0.0, "exit_code": 0}
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.learner.total_steps = steps
    cfg.learner.eval_every = steps  # the evaluator compiles too
    cfg.learner.checkpoint_every = steps
    _write_json(os.path.join(directory, "launch_config.json"), cfg.to_dict())
    t0 = time.time()
    code = run_child(directory, env, mode).wait(timeout_s, grace=STOP_GRACE_S)
    return {"steps": steps, "wall_s": round(time.time() - t0, 1), "exit_code": code}


def _warmup(c, workdir: str, first: RunSpec, ckpt: str, env: dict, log) -> float:
    """`warmup` of the grid's first run before any timed run; returns its seconds."""
    cfg = ml_collections.ConfigDict(first.config.to_dict())
    cfg.warm_start.checkpoint = ckpt
    out = warmup(cfg, os.path.join(workdir, "warmup"), c.runner.warmup_steps, env,
                 c.runner.run_timeout_s, check_mode(c.runner.get("mode", "pipeline")))
    if out["wall_s"]:
        log(f"  warmup ({out['steps']} steps of {first.name}, fills the XLA cache; not a "
            f"result) exit {out['exit_code']} in {out['wall_s']:.0f} s")
    return out["wall_s"]


def run_outcome(run_dir: str, code: int, since: float) -> str:
    """'done' | 'diverged' | 'failed' of a run attempt that started at `since` and exited with
    `code`: diverged when its learner recorded so (launch/outcome.py), whatever its log says."""
    if code == 0:
        return "done"
    if outcome.diverged(run_dir, since):
        return "diverged"  # the learner gave up on non-finite steps: an outcome, not a bug
    return "failed"


def _finish(run_dir: str, p: Child, code: int, cores, how: str, mode: str) -> str:
    """Writes the run's status.json: outcome, time, and where and how it ran (`provenance`:
    library versions, CPU, code version, machine; `mode`: runner.mode)."""
    status = run_outcome(run_dir, code, p.started_at)
    prev = _read_json(os.path.join(run_dir, "status.json")) or {}
    _write_json(os.path.join(run_dir, "status.json"), {
        "status": status, "returncode": code, "seconds": time.time() - p.started_at,
        "attempts": prev.get("attempts", 0) + 1, "cores": cores, "how": how,
        "mode": mode, "provenance": provenance(),
        "error": None if status == "done" else tail(p.log_path, 60)[-2000:]})
    return status


def _brief(run_dir: str) -> str:
    s = _read_json(os.path.join(run_dir, "summary.json")) or {}
    acc = s.get("eval_accuracy_last")
    return f" (held-out accuracy {acc:.3f})" if isinstance(acc, (int, float)) else ""


# ============================================================================ child side

def _child(mode: str, run_dir: str) -> int:
    """Runs the run described by run_dir/launch_config.json: `pipeline` (also `run`) launches
    its processes, `inprocess` runs it in this one."""
    run_dir = os.path.abspath(run_dir)
    cfg = ml_collections.ConfigDict(_read_json(os.path.join(run_dir, "launch_config.json")))
    if mode in ("run", "pipeline"):
        print(json.dumps(launch(cfg, run_dir, progress=False)), flush=True)
        return 0
    if mode == "inprocess":
        from pipelinerl_jax.launch.inprocess import run_inprocess  # JAX: after the fork
        print(json.dumps(run_inprocess(cfg, run_dir)), flush=True)
        return 0
    raise SystemExit(f"unknown mode {mode!r} (valid: {RUN_MODES})")


if __name__ == "__main__":
    exit_now(_child(sys.argv[1], sys.argv[2]))
