"""The child roles: queue server, learner, rollout worker, evaluator and the SFT warm start.

    python -m pipelinerl_jax.launch --role=worker --workdir=DIR [--index=I]

Every role reads `DIR/config.json` (the launcher writes it; a role started on its own is
given its config instead, see __main__.py and standalone.py), pins itself to its cores
(`resources.*`, pipelinerl_jax/resources.py) before JAX is imported, so XLA sizes its thread
pool to them, and stops cleanly on SIGTERM. Its accelerators come in its environment (the
launcher's `resources.role_env`: visible GPUs or TPU chips, a CPU device count). The SFT
role's DIR is the warm-start directory (`RUN/warm_start`); it writes `DIR/model`. The
evaluator (rollout/eval_role.py) evaluates the versions the learner hands it, on
`resources.evaluator_devices` or else worker 0's cores and devices, and ends once the learner's last version is evaluated. A learner
that stops on an exception leaves a `learner_stopped` record
in `DIR/events.jsonl` first (outcome.py). Hence the imports inside functions here: nothing
heavy may load before the pinning.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import List, Optional

from pipelinerl_jax.launch.outcome import record_learner_stopped
from pipelinerl_jax.launch.supervisor import Child, LaunchError
from pipelinerl_jax.resources import role_cores

ROLES = ("queue", "learner", "worker", "evaluator", "sft")
# stop_all: producers first, then the learner (it checkpoints on SIGTERM), then the queue.
STOP_RANK = {"worker": 0, "evaluator": 0, "sft": 0, "learner": 1, "queue": 2}


# ============================================================================ parent side

def child(role: str, workdir: str, index: int = 0, env: Optional[dict] = None,
          name: Optional[str] = None) -> Child:
    """The (not yet started) child process running `role` on `workdir`; its log is
    `workdir/logs/<name>.log` and its starts and exits go to `workdir/events.jsonl`."""
    name = name or (role if role != "worker" else f"worker{index}")
    cmd = [sys.executable, "-m", "pipelinerl_jax.launch", f"--role={role}",
           f"--workdir={workdir}", f"--index={index}"]
    return Child(name, cmd, os.path.join(workdir, "logs", f"{name}.log"), env=env,
                 events=os.path.join(workdir, "events.jsonl"), stop_rank=STOP_RANK[role])


# ============================================================================ child side

def run_role(role: str, workdir: str, index: int = 0, cfg=None,
             init_checkpoint: Optional[str] = None) -> int:
    """Runs `role` in this process until it ends; returns its exit code. `cfg` (default:
    `workdir/config.json`) and `init_checkpoint` (default: `workdir/init_checkpoint.txt`)
    are given when the role runs without the launcher (standalone.py)."""
    try:
        return _run_role(role, workdir, index, cfg, init_checkpoint)
    except Exception as e:
        if role == "learner":
            from pipelinerl_jax.learner.multihost import primary_or  # jax: pinned by now
            primary_or(lambda: record_learner_stopped(workdir, e), None)
        raise


def pin(cfg, role: str, index: int = 0) -> List[int]:
    """Pins this process to the cores of `role` (`resources.role_cores`) that exist here;
    returns them ([] = not pinned)."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    have = os.sched_getaffinity(0)
    cores = [c for c in role_cores(cfg.resources, role, index,
                                   num_workers=cfg.rollout.num_workers,
                                   sampler_kind=cfg.sampler.kind) if c in have]
    if cores:
        os.sched_setaffinity(0, cores)
    return cores


def _run_role(role: str, workdir: str, index: int, cfg, init_ckpt: Optional[str]) -> int:
    import ml_collections
    if cfg is None:
        with open(os.path.join(workdir, "config.json")) as f:
            cfg = ml_collections.ConfigDict(json.load(f))
    pin(cfg, role, index)
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
        from pipelinerl_jax.transport.queue_server import return_freed_buffers_to_the_os
        return_freed_buffers_to_the_os()  # this process is the queue
        server = RolloutQueueServer.from_config(cfg.transport).start()
        print(f"RolloutQueue listening on {server.address}", flush=True)
        stop.wait()
        server.stop(grace=1.0)
        return 0
    if role == "sft":
        print(json.dumps(evaluated_sft(cfg, workdir, progress=False)), flush=True)
        return 0
    if init_ckpt is None:
        with open(os.path.join(workdir, "init_checkpoint.txt")) as f:
            init_ckpt = f.read().strip()
    if role == "learner":
        from pipelinerl_jax.learner import multihost
        multihost.initialize(cfg.launch.get("learner_processes", 1))
        from pipelinerl_jax.learner.loop import learner_batches, run_learner
        from pipelinerl_jax.rollout.factory import backend
        from pipelinerl_jax.transport.weight_sink import NullSink, make_weight_sink
        # Process 0 publishes and hands versions to the evaluator; the others hold stand-ins.
        sink = multihost.primary_or(lambda: make_weight_sink(
            backend(cfg.sampler.kind).weight_sink, cfg, workdir, init_checkpoint=init_ckpt),
            NullSink())
        evals = multihost.primary_or(lambda: eval_outbox(cfg, workdir, init_ckpt), None)
        batches = learner_batches(cfg)
        try:
            out = run_learner(cfg, workdir, init_ckpt, stop_event=stop, batches=batches,
                              weight_sink=sink, evals=evals)
        finally:
            batches.close()
            sink.close()
        print(json.dumps(out), flush=True)
        return 0
    if role == "evaluator":
        from pipelinerl_jax.rollout.eval_role import run_evaluator
        print(json.dumps(run_evaluator(cfg, workdir, init_ckpt, stop)), flush=True)
        return 0
    if role == "worker":
        return _run_worker(cfg, workdir, index, init_ckpt, stop)
    raise LaunchError(f"unknown role {role!r}")


def eval_outbox(cfg, workdir: str, init_ckpt: str):
    """The learner's hand-over to the evaluator role (None when `learner.eval_every` is 0):
    versions due are saved as the run publishes them (`describe_run`: HF directories shaped
    like `init_ckpt` in the learner's dtypes, or under LoRA the adapters' PEFT directories)."""
    if cfg.learner.eval_every <= 0:
        return None
    from pipelinerl_jax.transport.eval_versions import EvalOutbox, eval_root
    from pipelinerl_jax.transport.weight_sink import hf_checkpoint_writer
    from pipelinerl_jax.transport.weight_version import describe_run
    describes = describe_run(cfg, init_ckpt)
    save = hf_checkpoint_writer(init_ckpt, cfg.model.dtype, cfg.model.param_dtype, describes)
    return EvalOutbox(eval_root(workdir), save, cfg.learner.eval_every,
                      cfg.learner.total_steps, describes)


def evaluated_sft(cfg, workdir: str, progress: bool = True) -> dict:
    """The warm start's SFT (`sft_on_demonstrations`) with held-out accuracy of the model's
    current parameters as its `evaluate` (none if eval_size is 0): one embedded evaluator engine serves every call (the first
    loads it from the model, later ones install the parameters as version `step`) and is
    closed when SFT ends."""
    from pipelinerl_jax.launch.demonstrations import sft_on_demonstrations
    held = {}

    def evaluate(model, step: int = 0):
        from pipelinerl_jax.models import flat_params
        if "ev" not in held:
            from pipelinerl_jax.envs import build_task
            from pipelinerl_jax.rollout.evaluator import Evaluator
            from pipelinerl_jax.tokenizer import get_tokenizer
            held["ev"] = Evaluator.embedded(cfg, model, build_task(cfg),
                                            get_tokenizer(cfg.tokenizer))
            return held["ev"].run(0)
        return held["ev"](flat_params(model), step)
    try:
        return sft_on_demonstrations(cfg, workdir, progress=progress,
                       evaluate=evaluate if cfg.learner.eval_size > 0 else None)
    finally:
        if "ev" in held:
            held.pop("ev").close()


def _run_worker(cfg, workdir: str, index: int, init_ckpt: str, stop: threading.Event) -> int:
    from pipelinerl_jax.rollout.factory import make_engine
    from pipelinerl_jax.envs import build_task
    from pipelinerl_jax.rollout.worker import RolloutWorker
    from pipelinerl_jax.tokenizer import get_tokenizer
    from pipelinerl_jax.transport import (RolloutQueueClient, WeightSubscriber, client_kwargs,
                                          queue_address, subscriber_kwargs, weights_address)
    tok, task = get_tokenizer(cfg.tokenizer), build_task(cfg)  # single-turn or environment
    # Version -1 until the learner's current weights arrive: nothing is sampled before.
    engine = make_engine(cfg, init_ckpt, index, workdir)
    client = RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport))
    client.wait_ready(60.0)
    worker = RolloutWorker(cfg, engine, task, tok, client, worker_index=index, workdir=workdir)
    sub = WeightSubscriber(weights_address(cfg.transport), worker.on_weights,
                           expected_shapes=engine.weight_shapes(), accepts=engine.serves,
                           **subscriber_kwargs(cfg.transport))
    threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
    try:
        worker.run()
    finally:
        sub.close()
        worker.close()
        engine.close()
        client.close()
    print(json.dumps({"worker": index, **dict(worker.counts)}), flush=True)
    return 0
