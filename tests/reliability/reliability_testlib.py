"""Helpers for the fault tests: start a real run in the background, watch its files, find
and signal its processes (by the pids the launcher records in `events.jsonl`, never by name)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from tests.pipeline_testlib import ROOT, TINY_FLAGS

# Fast, small runs: no held-out eval (it compiles a second engine in the learner).
FAST_FLAGS = TINY_FLAGS + ("--config.learner.eval_every=0", "--config.launch.shutdown_timeout_s=10")


def train_cmd(workdir, *flags) -> list:
    return [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
            f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick",
            f"--workdir={workdir}", *FAST_FLAGS, *flags]


def train_env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)  # one CPU device per process, as in a real run
    return env


def start_train(workdir, *flags) -> subprocess.Popen:
    """The real entry point, in the background (stdout/stderr kept in workdir/../*.txt)."""
    os.makedirs(workdir, exist_ok=True)
    out = open(os.path.join(workdir, "launcher.out"), "w")
    proc = subprocess.Popen(train_cmd(workdir, *flags), stdout=out, stderr=subprocess.STDOUT,
                            env=train_env(), cwd=ROOT, text=True, start_new_session=True)
    out.close()
    return proc


def read_jsonl(path) -> list:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):  # a line being written is not read yet
                rows.append(json.loads(line))
    return rows


def logs(workdir, n: int = 3000) -> str:
    out = ""
    for name in ["launcher.out"] + sorted(os.listdir(os.path.join(workdir, "logs"))
                                          if os.path.isdir(os.path.join(workdir, "logs"))
                                          else []):
        p = os.path.join(workdir, name) if name == "launcher.out" else \
            os.path.join(workdir, "logs", name)
        if os.path.isfile(p):
            out += f"\n--- {name} ---\n" + open(p, errors="replace").read()[-n:]
    return out


def wait_for(cond: Callable[[], object], workdir, proc: Optional[subprocess.Popen] = None,
             timeout: float = 300.0, what: str = "condition"):
    """Polls `cond()` until truthy; fails with the run's logs on timeout or early exit."""
    deadline = time.time() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run exited ({proc.returncode}) before {what}:{logs(workdir)}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}:{logs(workdir)}")
        time.sleep(0.1)


def finish(proc: subprocess.Popen, workdir, timeout: float = 300.0) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"run did not finish within {timeout}s:{logs(workdir)}") from None


def stop(proc: subprocess.Popen) -> None:
    """Stops a launcher we started (SIGTERM: it stops its children), then kills it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def events(workdir) -> list:
    return read_jsonl(os.path.join(workdir, "events.jsonl"))


def pid_of(workdir, child: str) -> int:
    """Pid of the current incarnation of `child` ('queue', 'learner', 'worker0')."""
    starts = [e for e in events(workdir) if e["event"] == "start" and e["child"] == child]
    assert starts, f"no start event for {child}"
    return starts[-1]["pid"]


def max_step(workdir) -> int:
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return max((r["step"] for r in rows), default=0)


def committed(workdir, step: int) -> bool:
    """Checkpoint `step` is complete (orbax renames its temporary directory at the end)."""
    return os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def tiny_config():
    """The experiment config of the tiny runs, for in-process tests (worker, engine)."""
    from pipelinerl_jax.run_config import base_config, resolve
    cfg = base_config()
    cfg.task.median_length, cfg.task.p99_length, cfg.task.max_length = 3, 6, 8
    cfg.sampling.max_new_tokens = 9
    cfg.model.max_seq_len = 32
    cfg.engine.max_slots = 8
    cfg.learner.batch_groups = cfg.rollout.group_size = 2
    return resolve(cfg)


def weights_publisher_main(conn, files: dict, chunk_bytes: int,
                           address: str = "127.0.0.1:0") -> None:
    """A weight publisher process (a learner stand-in, meant to be SIGKILLed) driven over a
    pipe: `version` publishes the safetensors file `files[version]` as that version."""
    from safetensors.numpy import load_file
    from tests.transport.flat_weights import FlatPublisher as WeightPublisher
    pub = WeightPublisher(address, chunk_bytes=chunk_bytes)
    conn.send(pub.port)
    while True:
        version = conn.recv()
        pub.publish(version, load_file(files[version]))
        conn.send(version)


def run_config(workdir) -> dict:
    with open(os.path.join(workdir, "config.json")) as f:
        return json.load(f)


def queue_client(workdir):
    """A RolloutQueueClient to the run's queue (address and credentials from config.json)."""
    import ml_collections
    from pipelinerl_jax.transport import RolloutQueueClient, client_kwargs, queue_address
    t = ml_collections.ConfigDict(run_config(workdir)["transport"])
    return RolloutQueueClient(queue_address(t), **client_kwargs(t))


def checkpoint_state(workdir, step: int) -> list:
    """The leaves of the TrainState saved at `step` (host arrays)."""
    import jax
    import orbax.checkpoint as ocp
    from pipelinerl_jax.learner.checkpoint import Checkpointer
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    out = ckpt._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    ckpt.close()
    return jax.tree.leaves(jax.device_get(out["state"]))
