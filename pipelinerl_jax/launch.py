"""Process orchestration: queue server, rollout workers and learner as separate processes.

    launch(config, workdir)          # what experiments/train.py calls

1. validate the config (before any process starts) and write `workdir/config.json`;
2. warm start: supervised training on the task's demonstrations in a child process, unless
   a checkpoint is given or already in the workdir (`workdir/warm_start/model`);
3. start the queue server, the learner and `rollout.num_workers` workers, each pinned to its
   cores (`resources.*`; set before JAX is imported, so XLA sizes its thread pool to them);
4. watch them: show a progress bar fed by `metrics.jsonl`; restart a child that dies, up to
   `launch.max_{worker,queue,learner}_restarts` times (a restarted queue comes back empty on
   the same address: clients reconnect, workers regenerate what it lost; a restarted learner
   resumes from its last committed checkpoint and the queue redelivers what it had not
   acknowledged); past that, stop everything and fail with the tail of the child's log;
   on Ctrl-C / SIGTERM stop the children cleanly. Every start and restart is a line of
   `workdir/events.jsonl` (time, child, pid, exit code);
5. when the learner finishes, stop workers and queue, and plot reward vs wall-clock.

Every address is a config value (`transport.host`, ports; 0 = pick a free port), so the
same roles run across hosts: `python -m pipelinerl_jax.launch --role=worker --workdir=DIR`
on a sampler host with the same `config.json`. A multi-host learner calls
`jax.distributed.initialize()` when `JAX_COORDINATOR_ADDRESS` is set (one learner process
per host; only process 0 pulls batches and publishes weights).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

ROLES = ("queue", "learner", "worker", "sft")


class LaunchError(RuntimeError):
    pass


# ============================================================================ parent side

def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


class Child:
    def __init__(self, role: str, workdir: str, index: int = 0):
        self.role, self.workdir, self.index = role, workdir, index
        self.name = role if role != "worker" else f"worker{index}"
        self.log_path = os.path.join(workdir, "logs", f"{self.name}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0

    def start(self) -> "Child":
        from pipelinerl_jax.metrics import append_jsonl
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log = open(self.log_path, "a")
        cmd = [sys.executable, "-m", "pipelinerl_jax.launch", f"--role={self.role}",
               f"--workdir={self.workdir}", f"--index={self.index}"]
        # New session: a Ctrl-C in the terminal reaches the launcher only, which then stops
        # the children in order.
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ))
        log.close()
        append_jsonl(os.path.join(self.workdir, "events.jsonl"), [{
            "time_s": time.time(), "event": "start", "child": self.name, "pid": self.proc.pid,
            "restarts": self.restarts}])
        return self

    def restart(self, code: int, limit: int) -> None:
        """Starts the child again after it exited with `code`; LaunchError past `limit`."""
        from pipelinerl_jax.metrics import append_jsonl
        append_jsonl(os.path.join(self.workdir, "events.jsonl"), [{
            "time_s": time.time(), "event": "exit", "child": self.name, "code": code,
            "restarts": self.restarts}])
        if self.restarts >= limit:
            raise LaunchError(f"{self.name} exited with {code} and was restarted "
                              f"{self.restarts} times already (limit {limit}):\n"
                              f"{_tail(self.log_path)}")
        self.restarts += 1
        with open(self.log_path, "a") as f:
            f.write(f"\n[launcher] {self.name} exited with {code}; restart {self.restarts}\n")
        self.start()

    def poll(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _warm_start(cfg, workdir: str, children: List[Child]) -> str:
    """The checkpoint RL starts from; runs SFT in a child process when needed."""
    if cfg.warm_start.checkpoint:
        return cfg.warm_start.checkpoint
    ws_dir = os.path.join(workdir, "warm_start")
    ckpt = os.path.join(ws_dir, "model")
    if os.path.isfile(os.path.join(ckpt, "config.json")):
        return ckpt  # resuming a run: the warm start is done
    if cfg.warm_start.steps > 0 or cfg.model.init == "scratch":
        child = Child("sft", workdir).start()
        children.append(child)
        print(f"warm start: {cfg.warm_start.steps} supervised steps "
              f"(log: {child.log_path})", flush=True)
        _follow_sft(child, ws_dir)
        if child.proc.returncode != 0:
            raise LaunchError(f"warm start failed (exit {child.proc.returncode}):\n"
                              f"{_tail(child.log_path)}")
        children.remove(child)
        return ckpt
    return cfg.model.path


def _follow_sft(child: Child, ws_dir: str) -> None:
    from tqdm import tqdm
    from pipelinerl_jax.metrics import read_jsonl
    cfg_steps = None
    bar = None
    while child.poll() is None:
        time.sleep(1.0)
        rows = read_jsonl(os.path.join(ws_dir, "sft_metrics.jsonl"))
        if rows:
            if bar is None:
                cfg_steps = json.load(open(os.path.join(child.workdir, "config.json")))[
                    "warm_start"]["steps"]
                bar = tqdm(total=cfg_steps, desc="warm start", unit="step", dynamic_ncols=True)
            if bar.n != rows[-1]["step"] + 1:
                bar.n = rows[-1]["step"] + 1
                bar.set_postfix(loss=f"{rows[-1]['sft/loss']:.3f}")
                bar.refresh()
    if bar is not None:
        bar.n = cfg_steps
        bar.close()
    summary = os.path.join(ws_dir, "sft_summary.json")
    if os.path.exists(summary):
        s = json.load(open(summary))
        extra = f", held-out accuracy {s['eval/accuracy']:.3f}" if "eval/accuracy" in s else ""
        print(f"warm start done in {s['time_s']:.0f}s (loss {s['final_loss']:.3f}{extra})",
              flush=True)


class Monitor:
    """Progress bar over `metrics.jsonl` (the learner writes it; we only read)."""

    def __init__(self, workdir: str, total: int):
        from tqdm import tqdm
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.bar = tqdm(total=total, desc="RL", unit="step", dynamic_ncols=True)
        self._pos = 0
        self.last: Dict = {}

    def update(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self._pos)
            chunk = f.read()
        lines = chunk.split("\n")
        self._pos += len(chunk) - len(lines[-1])
        changed = False
        for line in lines[:-1]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.last.update({k: v for k, v in row.items() if not isinstance(v, list)})
            changed = True
        if changed:
            self.bar.n = self.last.get("step", 0)
            post = {}
            for key, short in (("reward/mean", "reward"), ("eval/accuracy", "eval_acc"),
                               ("lag/mean", "lag"), ("sampler/occupancy", "occ")):
                if isinstance(self.last.get(key), (int, float)):
                    post[short] = f"{self.last[key]:.3f}"
            self.bar.set_postfix(post)
            self.bar.refresh()

    def close(self):
        self.update()
        self.bar.close()


def launch(cfg, workdir: str, progress: bool = True) -> dict:
    """Runs a whole experiment; returns the learner's final metrics (see module docstring)."""
    from pipelinerl_jax import run_config
    from pipelinerl_jax.metrics import plot_reward, read_jsonl

    run_config.validate(cfg)
    cfg = run_config.resolve(cfg)
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
        init_ckpt = _warm_start(cfg, workdir, children)
        with open(os.path.join(workdir, "init_checkpoint.txt"), "w") as f:
            f.write(init_ckpt)
        if stopping.is_set():
            raise KeyboardInterrupt
        queue = Child("queue", workdir).start()
        children.append(queue)
        _wait_queue(cfg, queue)
        learner = Child("learner", workdir).start()
        workers = [Child("worker", workdir, i).start() for i in range(cfg.rollout.num_workers)]
        children += [learner] + workers
        monitor = Monitor(workdir, cfg.learner.total_steps) if progress else None
        while True:
            if stopping.is_set():
                raise KeyboardInterrupt
            if monitor is not None:
                monitor.update()
            code = learner.poll()
            if code == 0:
                break
            if code is not None:
                learner.restart(code, cfg.launch.max_learner_restarts)
            code = queue.poll()
            if code is not None:  # same address; it comes back empty
                queue.restart(code, cfg.launch.max_queue_restarts)
                _wait_queue(cfg, queue)
            for w in workers:
                code = w.poll()
                if code is not None:
                    w.restart(code, cfg.launch.max_worker_restarts)
            time.sleep(0.5)
        if monitor is not None:
            monitor.close()
    except KeyboardInterrupt:
        print("\nstopping (interrupted) ...", flush=True)
        _stop_all(children, cfg.launch.shutdown_timeout_s)
        raise
    except BaseException:
        _stop_all(children, cfg.launch.shutdown_timeout_s)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    _stop_all(children, cfg.launch.shutdown_timeout_s)
    plot = plot_reward(workdir)
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    final = {k: v for k, v in (rows[-1] if rows else {}).items() if not isinstance(v, list)}
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    summary = {"workdir": workdir, "plot": plot, "steps": final.get("step", 0),
               "wall_time_s": final.get("wall_time_s"),
               "eval_accuracy_first": evals[0] if evals else None,
               "eval_accuracy_last": evals[-1] if evals else None}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _wait_queue(cfg, queue: Child) -> None:
    from pipelinerl_jax.transport import RolloutQueueClient, client_kwargs, queue_address
    client = RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport))
    deadline = time.time() + cfg.launch.startup_timeout_s
    try:
        while True:
            if queue.poll() is not None:
                raise LaunchError(f"queue server failed to start:\n{_tail(queue.log_path)}")
            try:
                client.wait_ready(2.0)
                return
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline:
                    raise LaunchError(f"queue server not ready after "
                                      f"{cfg.launch.startup_timeout_s}s") from None
    finally:
        client.close()


def _stop_all(children: List[Child], timeout: float) -> None:
    # Producers first, then the learner (it checkpoints on SIGTERM), then the queue.
    order = {"worker": 0, "sft": 0, "learner": 1, "queue": 2}
    for c in sorted(children, key=lambda c: order[c.role]):
        c.stop(timeout)


# ============================================================================ child side

def _pin(cores: List[int]) -> None:
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def _child(role: str, workdir: str, index: int) -> int:
    import ml_collections
    from pipelinerl_jax.run_config import parse_cores
    with open(os.path.join(workdir, "config.json")) as f:
        cfg = ml_collections.ConfigDict(json.load(f))
    if role == "learner":
        _pin(parse_cores(cfg.resources.learner_cores, "resources.learner_cores"))
    elif role in ("worker",):
        _pin(parse_cores(cfg.resources.sampler_cores, "resources.sampler_cores"))
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    if role != "queue":
        from pipelinerl_jax import compile_cache
        compile_cache.enable()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if role == "queue":
        from pipelinerl_jax.transport import RolloutQueueServer
        server = RolloutQueueServer.from_config(cfg.transport).start()
        print(f"RolloutQueue listening on {server.address}", flush=True)
        stop.wait()
        server.stop(grace=1.0)
        return 0
    if role == "sft":
        from pipelinerl_jax.learner.sft import run_sft
        run_sft(cfg, os.path.join(workdir, "warm_start"), progress=False,
                evaluate=_sft_evaluator(cfg))
        return 0
    init_ckpt = open(os.path.join(workdir, "init_checkpoint.txt")).read().strip()
    if role == "learner":
        if os.environ.get("JAX_COORDINATOR_ADDRESS"):
            import jax
            jax.distributed.initialize()
        from pipelinerl_jax.learner.loop import run_learner
        from pipelinerl_jax.rollout.evaluator import learner_evaluator
        from pipelinerl_jax.transport.weight_sink import make_weight_sink
        # TODO(backend table): the sampler kind's table entry names its sink
        sink = make_weight_sink("hf_dir" if cfg.sampler.kind == "sglang" else "stream", cfg,
                                workdir, init_checkpoint=init_ckpt)
        evaluate = learner_evaluator(cfg, init_ckpt)
        try:
            out = run_learner(cfg, workdir, init_ckpt, stop_event=stop, weight_sink=sink,
                              evaluate=evaluate)
        finally:
            sink.close()
            if evaluate is not None:
                evaluate.close()
        print(json.dumps(out), flush=True)
        return 0
    if role == "worker":
        return _run_worker(cfg, workdir, index, init_ckpt, stop)
    raise LaunchError(f"unknown role {role!r}")


def _sft_evaluator(cfg):
    if cfg.learner.eval_size <= 0:
        return None

    def evaluate(model):
        from pipelinerl_jax.rollout.evaluator import Evaluator
        from pipelinerl_jax.models import flat_params
        from pipelinerl_jax.tasks import get_task
        from pipelinerl_jax.tokenizers import get_tokenizer
        ev = Evaluator(cfg, model, get_task(cfg.task), get_tokenizer(cfg.tokenizer))
        try:
            return ev(flat_params(model), 0)
        finally:
            ev.close()
    return evaluate


def _run_worker(cfg, workdir: str, index: int, init_ckpt: str, stop: threading.Event) -> int:
    from pipelinerl_jax.rollout.factory import make_engine
    from pipelinerl_jax.rollout.worker import RolloutWorker
    from pipelinerl_jax.tasks import get_task
    from pipelinerl_jax.tokenizers import get_tokenizer
    from pipelinerl_jax.transport import (RolloutQueueClient, WeightSubscriber, client_kwargs,
                                          queue_address, subscriber_kwargs, weights_address)
    tok, task = get_tokenizer(cfg.tokenizer), get_task(cfg.task)
    # Version -1 until the learner's current weights arrive: nothing is sampled before.
    engine = make_engine(cfg, init_ckpt, index, workdir)
    client = RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport))
    client.wait_ready(60.0)
    worker = RolloutWorker(cfg, engine, task, tok, client, worker_index=index, workdir=workdir)
    sub = WeightSubscriber(weights_address(cfg.transport), worker.on_weights,
                           **subscriber_kwargs(cfg.transport))
    threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
    try:
        worker.run()
    finally:
        sub.close()
        engine.close()
        client.close()
    print(json.dumps({"worker": index, **dict(worker.counts)}), flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--index", type=int, default=0)
    args = p.parse_args(argv)
    return _child(args.role, os.path.abspath(args.workdir), args.index)


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001
        # A child that fails must exit, so the launcher sees it: an exception that skipped
        # the child's cleanup leaves non-daemon threads (gRPC servers, checkpoint and
        # TensorBoard writers) that would keep the interpreter alive forever.
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)
