"""One run: queue server, rollout workers, learner and evaluator as separate, supervised
processes.

    launch(config, workdir)          # what experiments/train.py calls

1. validate the config (before any process starts) and write `workdir/config.json`;
2. warm start (warm_start.py): SFT on the task's demonstrations in a child process, unless a
   checkpoint is given or already in the workdir (`workdir/warm_start/model`);
3. start the queue server, the learner, `rollout.num_workers` workers and (unless
   `learner.eval_every` is 0) the evaluator (roles.py) at once (learner and workers wait for
   the queue), each pinned to its cores and given its own accelerators in its environment
   (`resources.learner_devices` / `resources.sampler_devices`; pipelinerl_jax/resources.py;
   the evaluator samples on worker 0's);
4. watch them: show a progress bar fed by `metrics.jsonl` (progress.py); restart a child that
   dies, up to `launch.max_{worker,queue,learner}_restarts` times (a restarted queue comes
   back empty on the same address: clients reconnect, workers regenerate what it lost; a
   restarted learner resumes from its last committed checkpoint and the queue redelivers what
   it had not acknowledged); past that, stop everything and fail with the tail of the child's
   log; on Ctrl-C / SIGTERM stop the children cleanly. Every start and restart is a line of
   `workdir/events.jsonl` (time, child, pid, exit code; supervisor.py). The evaluator is
   restarted like a worker (`launch.max_worker_restarts`); it resumes with the versions the
   learner handed over that it had not evaluated;
5. when the learner finishes, stop workers and queue, wait for the evaluator to evaluate the
   learner's last version, and plot reward vs wall-clock; `summary.json` holds the first and
   last held-out accuracy (`metrics.read_metrics`: the learner's rows with the evaluator's
   records merged in).

Every address is a config value (`transport.host`, ports; 0 = pick a free port), so the
same roles run across hosts (docs/multihost.md). `launch.learner_processes=P` starts the
learner as P `jax.distributed` processes supervised as one group (learner_group.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import List

from pipelinerl_jax import resources, run_config
from pipelinerl_jax.launch import roles
from pipelinerl_jax.launch.learner_group import LearnerGroup, warm_start_env
from pipelinerl_jax.launch.progress import Monitor
from pipelinerl_jax.launch.supervisor import Child, LaunchError, stop_all, tail
from pipelinerl_jax.launch.warm_start import warm_start


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(cfg, workdir: str, progress: bool = True) -> dict:
    """Runs a whole experiment; returns the learner's final metrics (see module docstring)."""
    from pipelinerl_jax.transport.eval_versions import clear_final, eval_root

    run_config.validate(cfg)
    cfg = run_config.resolve(cfg)
    # Children pin and split by the platform of this host, not 'auto'.
    cfg.resources.platform = resources.resolve_platform(cfg.resources.platform, os.environ)
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    t = cfg.transport
    if t.queue_port == 0:
        t.queue_port = _free_port(t.host)
    if t.weights_port == 0:
        t.weights_port = _free_port(t.host)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(cfg.to_json(indent=2))

    children: List[Child] = []
    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if cfg.resources.learner_devices or cfg.resources.sampler_devices:
            print(resources.describe(cfg.resources, num_workers=cfg.rollout.num_workers,
                                     sampler_kind=cfg.sampler.kind), flush=True)
        init_ckpt = warm_start(cfg, workdir, progress=progress, stopping=stopping,
                               env=warm_start_env(cfg, child_env(cfg, "sft")))
        with open(os.path.join(workdir, "init_checkpoint.txt"), "w") as f:
            f.write(init_ckpt)
        if stopping.is_set():
            raise KeyboardInterrupt
        # The learner and the workers wait for the queue themselves: start them with it,
        # so their start-up (imports, model load) overlaps the queue's.
        queue = roles.child("queue", workdir).start()
        children.append(queue)
        learner = LearnerGroup(cfg, workdir, env=child_env(cfg, "learner")).start()
        workers = [roles.child("worker", workdir, i, env=child_env(cfg, "worker", i)).start()
                   for i in range(cfg.rollout.num_workers)]
        children += [learner] + workers
        evaluator = None
        if cfg.learner.eval_every > 0:
            clear_final(eval_root(workdir))  # an earlier run's end is not this one's
            evaluator = roles.child("evaluator", workdir,
                                    env=child_env(cfg, "evaluator")).start()
            children.append(evaluator)
        _wait_queue(cfg, queue)
        monitor = Monitor(workdir, cfg.learner.total_steps) if progress else None
        while True:
            if stopping.is_set():
                raise KeyboardInterrupt
            if monitor is not None:
                monitor.update()
            code = learner.poll(timeout=0.5)  # returns the moment the learner exits
            if code == 0:
                learner.exited(code)
                break
            if code is not None:
                learner.restart(code, cfg.launch.max_learner_restarts)
            code = queue.poll()
            if code is not None:  # same address; it comes back empty
                queue.restart(code, cfg.launch.max_queue_restarts)
                _wait_queue(cfg, queue)
            for w in workers + ([evaluator] if evaluator is not None else []):
                code = w.poll()
                if code is not None and not (w is evaluator and code == 0):
                    w.restart(code, cfg.launch.max_worker_restarts)
        # Sampling is over; the evaluator finishes the versions it was handed, the last one
        # included, with the machine to itself.
        stop_all(workers + [queue], cfg.launch.shutdown_timeout_s)
        while evaluator is not None:
            if stopping.is_set():
                raise KeyboardInterrupt
            if monitor is not None:
                monitor.update()
            code = evaluator.poll(timeout=0.5)
            if code == 0:
                evaluator.exited(code)
                break
            if code is not None:
                evaluator.restart(code, cfg.launch.max_worker_restarts)
        if monitor is not None:
            monitor.close()
    except KeyboardInterrupt:
        print("\nstopping (interrupted) ...", flush=True)
        stop_all(children, cfg.launch.shutdown_timeout_s)
        raise
    except BaseException:
        stop_all(children, cfg.launch.shutdown_timeout_s)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    stop_all(children, cfg.launch.shutdown_timeout_s)
    return write_summary(workdir)


def write_summary(workdir: str) -> dict:
    """The end of a run, whichever way it ran: reward vs wall-clock plotted and
    `summary.json` (first and last held-out accuracy); returns the summary."""
    from pipelinerl_jax.metrics import plot_reward, read_metrics  # numpy: roles pin first
    plot = plot_reward(workdir)
    rows = read_metrics(workdir)
    final = {k: v for k, v in (rows[-1] if rows else {}).items() if not isinstance(v, list)}
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    summary = {"workdir": workdir, "plot": plot, "steps": final.get("step", 0),
               "wall_time_s": final.get("wall_time_s"),
               "eval_accuracy_first": evals[0] if evals else None,
               "eval_accuracy_last": evals[-1] if evals else None}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def child_env(cfg, role: str, index: int = 0) -> dict:
    """This process's environment plus the accelerators of `role` (resources.role_env). An
    evaluator without `resources.evaluator_devices` gets worker 0's (resources.placed_as):
    on a GPU it shares with that worker it does not preallocate memory, and a TPU chip, which
    one process only can open, leaves it on the CPU."""
    env = resources.role_env(cfg.resources, role, index,
                             num_workers=cfg.rollout.num_workers,
                             sampler_kind=cfg.sampler.kind, base=os.environ)
    shares = role == "evaluator" and not cfg.resources.evaluator_devices
    if shares and env != dict(os.environ):
        if cfg.resources.platform == "gpu" and "CUDA_VISIBLE_DEVICES" in env:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        elif cfg.resources.platform == "tpu" and "TPU_VISIBLE_CHIPS" in env:
            env = dict(os.environ, JAX_PLATFORMS="cpu")
    return env


def _wait_queue(cfg, queue: Child) -> None:
    from pipelinerl_jax.transport import (  # grpc, numpy: roles pin cores first
        RolloutQueueClient, client_kwargs, queue_address)
    client = RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport))
    deadline = time.time() + cfg.launch.startup_timeout_s
    try:
        while True:
            if queue.poll() is not None:
                raise LaunchError(f"queue server failed to start:\n{tail(queue.log_path)}")
            try:
                client.wait_ready(2.0)
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline:
                    raise LaunchError(f"queue server not ready after "
                                      f"{cfg.launch.startup_timeout_s}s") from None
    finally:
        client.close()
