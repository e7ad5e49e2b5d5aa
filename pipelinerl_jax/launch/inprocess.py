"""A lag-injected run in one process: the pipeline's parts, an in-memory queue, no gRPC.

    run_inprocess(config, workdir)   # what the ablation runner calls with runner.mode='inprocess'

Under lag injection (`pipelinerl_jax.lag_injection`) a run is lock-step: the learner ships
the weights of version L - k, the worker samples batch L with them, the learner trains on it.
Nothing depends on timing, so the processes, sockets and serialization of the pipeline
(`launcher.launch`: queue server, learner, worker and evaluator processes) buy nothing but
start-up and hand-off costs. This runs the same parts in one process:

    learner     `learner.loop.run_learner` (main thread), unchanged: its batch source is a
                `transport.local_queue.LocalQueue` (the queue's `QueueCore`, rollouts
                converted, validated and decoded as the gRPC server and client do), its
                weight sink hands each version to the worker (`WorkerSink`);
    worker      `rollout.worker.RolloutWorker` (a thread) with the run's group source, scorer
                and `InjectedLagAdmission`, over the engine `rollout.factory.make_engine`
                builds, putting to the same `LocalQueue`;
    evaluator   `rollout.eval_role.InlineEvaluator`: the evaluator role's engine and
                `Evaluator`, evaluating each due version on the learner's publication thread
                and writing the same `eval.jsonl` records.

The trained batches, losses and held-out accuracies are those of the pipeline run of the same
config (tests/launch/test_inprocess.py compares them). What is left out: restarts (a failed
run is rerun by the ablation runner), multi-process learners, several workers, SGLang.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
from typing import Optional

from pipelinerl_jax import run_config
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.launch.launcher import write_summary
from pipelinerl_jax.launch.outcome import record_learner_stopped
from pipelinerl_jax.launch.roles import pin
from pipelinerl_jax.launch.warm_start import warm_start

log = logging.getLogger(__name__)


def check_inprocess(cfg) -> None:
    """Raises ConfigError naming the key when `cfg` cannot run in one process."""
    if not cfg.lag_injection.enabled:
        raise ConfigError("lag_injection.enabled", "the single-process mode runs lag-injected "
                          "(lock-step) runs only; an async run's timing is the pipeline's")
    if cfg.sampler.kind != "jax":
        raise ConfigError("sampler.kind", f"the single-process mode embeds the JaxEngine; "
                          f"got {cfg.sampler.kind!r}")
    if cfg.rollout.num_workers != 1:
        raise ConfigError("rollout.num_workers", f"the single-process mode runs one worker; "
                          f"got {cfg.rollout.num_workers}")
    if cfg.launch.get("learner_processes", 1) != 1:
        raise ConfigError("launch.learner_processes", "the single-process mode runs one "
                          "learner process")


class WorkerSink:
    """The learner's weight sink when the worker is in this process: each version goes
    straight to `on_weights` (what the weight subscriber calls in the pipeline), as the run's
    `describes` (a `WeightVersion` description) carrying the learner's tensors."""

    def __init__(self, on_weights, describes):
        self.on_weights, self.describes = on_weights, describes

    def publish(self, version: int, params, policy_version=None) -> None:
        self.on_weights(self.describes.carrying(version, tensors=params,
                                                policy_version=policy_version))

    def close(self) -> None:
        pass


def run_inprocess(cfg, workdir: str) -> dict:
    """Runs the lag-injected experiment `cfg` in this process (module docstring); returns
    the run's summary (as `launch` does)."""
    run_config.validate(cfg)
    cfg = run_config.resolve(cfg)
    check_inprocess(cfg)
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(cfg.to_json(indent=2))
    init_ckpt = warm_start(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "init_checkpoint.txt"), "w") as f:
        f.write(init_ckpt)
    pin(cfg, "learner")  # the runner gives learner and sampler the same cores
    from pipelinerl_jax import compile_cache
    compile_cache.enable()
    stop = threading.Event()  # SIGTERM / Ctrl-C: the learner checkpoints and stops, as a role
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda *_: stop.set())
    train(cfg, workdir, init_ckpt, stop)
    if stop.is_set():
        raise KeyboardInterrupt("stopped before the last step; rerun to resume")
    return write_summary(workdir)


def train(cfg, workdir: str, init_ckpt: str, stop: Optional[threading.Event] = None) -> dict:
    """The learner, worker and evaluator of a resolved, checked config, wired in memory;
    `stop`, once set, ends the run at the next step (after a checkpoint)."""
    from pipelinerl_jax.envs import build_task
    from pipelinerl_jax.learner.loop import run_learner
    from pipelinerl_jax.rollout.eval_role import InlineEvaluator
    from pipelinerl_jax.rollout.factory import make_engine
    from pipelinerl_jax.rollout.worker import RolloutWorker
    from pipelinerl_jax.tokenizer import get_tokenizer
    from pipelinerl_jax.transport.local_queue import LocalQueue
    from pipelinerl_jax.transport.weight_version import describe_run
    tok, task = get_tokenizer(cfg.tokenizer), build_task(cfg)
    queue = LocalQueue.from_config(cfg.transport)
    engine = make_engine(cfg, init_ckpt, 0, workdir)
    worker = RolloutWorker(cfg, engine, task, tok, queue, worker_index=0, workdir=workdir)
    describes = describe_run(cfg, init_ckpt)
    evals = (InlineEvaluator(cfg, workdir, init_ckpt, describes)
             if cfg.learner.eval_every > 0 else None)
    stop, failed = stop or threading.Event(), []

    def sample():
        try:
            worker.run()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread below
            failed.append(e)
            stop.set()  # the learner would wait for batches that never come

    thread = threading.Thread(target=sample, name="rollout-worker", daemon=True)
    thread.start()
    try:
        out = run_learner(cfg, workdir, init_ckpt, stop_event=stop, batches=queue,
                          weight_sink=WorkerSink(worker.on_weights, describes), evals=evals)
    except Exception as e:
        record_learner_stopped(workdir, e)  # a diverged learner is an outcome (outcome.py)
        raise
    finally:
        worker.stop()
        thread.join()
        worker.close()
        engine.close()
        if evals is not None:
            evals.close()
        queue.close()
    if failed:
        raise RuntimeError("the rollout worker failed") from failed[0]
    print(json.dumps({"worker": 0, **dict(worker.counts)}), flush=True)
    return out
