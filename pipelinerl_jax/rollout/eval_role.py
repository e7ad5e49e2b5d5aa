"""The evaluator role: held-out evaluation of a run's versions, off the learner's step.

    python -m pipelinerl_jax.launch --role=evaluator --workdir=DIR    # the launcher starts it

The learner hands over the versions its schedule evaluates (step 0, every `learner.eval_every`
steps and its last; `eval_versions.py`) and trains on. This process evaluates each, oldest
first, with an engine of the run's own backend, built by the factory the rollout workers use
(`rollout.factory.make_engine` on `evaluator.eval_view(cfg)`: JAX, or SGLang servers of
`sglang.eval_urls`), and writes one record per version, `{"step": its learner step,
"version", "eval/accuracy", ...}`, to `DIR/eval.jsonl` and to TensorBoard (its own event file
in `DIR/tb`). `metrics.read_metrics` merges those records into the learner's rows of
`metrics.jsonl`, so every report sees them where they always were. The role ends once the
learner's last version is evaluated; the launcher waits for it before it finishes the run.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

from pipelinerl_jax.metrics import EVAL_LOG
from pipelinerl_jax.transport.eval_versions import EvalInbox, due
from pipelinerl_jax.transport.weight_sink import read_weight_version

log = logging.getLogger(__name__)


class EvalLoop:
    """Evaluates what the learner handed over, oldest first, until it finished.

    `evaluate(path, version) -> metrics`: installs the HF directory `path` as `version` and
    evaluates it. `write(version, record)`: stores a record (`MetricsWriter.write`)."""

    def __init__(self, inbox: EvalInbox, evaluate: Callable[[str, int], dict],
                 write: Callable[[int, dict], None], poll_s: float = 0.5):
        self.inbox, self.evaluate, self.write, self.poll_s = inbox, evaluate, write, poll_s
        self.evaluated = []  # versions, in the order evaluated

    def drain(self) -> None:
        """Evaluates every version handed over so far."""
        for version, path in self.inbox.pending():
            metrics = self.evaluate(path, version)
            self.write(version, {"version": version, **metrics})
            self.inbox.done(version)
            self.evaluated.append(version)
            log.info("evaluated version %d: %s", version,
                     {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})

    def run(self, stop: Optional[threading.Event] = None) -> bool:
        """Until the learner's last version is evaluated (True) or `stop` is set (False)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            finished = self.inbox.final() is not None  # read first: written after the last
            self.drain()
            if finished and not self.inbox.pending():
                return True
            stop.wait(self.poll_s)
        return False


def engine_evaluate(engine, evaluator) -> Callable[[str, int], dict]:
    """`evaluate(path, version)` over an engine and an `Evaluator` of it: the directory's
    message (`weight_sink.read_weight_version`), installed by its kind. A version at or
    below the engine's (a learner restarted from an older checkpoint trains it again) is
    installed as given."""
    def evaluate(path: str, version: int) -> dict:
        message = read_weight_version(path, engine.serves)
        engine.update_weights(message, version, allow_older=version <= engine.version)
        return evaluator.run(version)
    return evaluate


def run_evaluator(cfg, workdir: str, init_checkpoint: str,
                  stop: Optional[threading.Event] = None) -> dict:
    """The role (module docstring); returns the versions it evaluated."""
    from pipelinerl_jax.envs import build_task
    from pipelinerl_jax.metrics import MetricsWriter
    from pipelinerl_jax.transport.eval_versions import eval_root
    from pipelinerl_jax.rollout.evaluator import Evaluator, eval_view
    from pipelinerl_jax.rollout.factory import make_engine
    from pipelinerl_jax.tokenizer import get_tokenizer
    engine = make_engine(eval_view(cfg), init_checkpoint, 0, workdir)  # version -1
    evaluator = Evaluator(cfg, engine, build_task(cfg), get_tokenizer(cfg.tokenizer))
    writer = MetricsWriter(workdir, EVAL_LOG, tb_suffix=".evaluator")
    loop = EvalLoop(EvalInbox(eval_root(workdir)), engine_evaluate(engine, evaluator),
                    writer.write)
    try:
        finished = loop.run(stop)
    finally:
        writer.close()
        evaluator.close()
        engine.close()
    return {"evaluator": "finished" if finished else "stopped", "evaluated": loop.evaluated,
            "workdir": os.path.abspath(workdir)}


class InlineEvaluator:
    """The evaluator role inside the learner's process (single-process runs,
    `launch/inprocess.py`): the `EvalOutbox` interface the learner hands versions to, but each
    due version is evaluated at once, by the role's engine and `Evaluator`, from the flat
    params themselves (the role reads them back from the float32 HF directory the outbox
    writes: the same values), and its record written to `eval.jsonl` as the role writes it.
    `describes`: the run's `WeightVersion` description (full weights, or LoRA adapters)."""

    def __init__(self, cfg, workdir: str, init_checkpoint: str, describes):
        from pipelinerl_jax.envs import build_task
        from pipelinerl_jax.metrics import MetricsWriter
        from pipelinerl_jax.rollout.evaluator import Evaluator, eval_view
        from pipelinerl_jax.rollout.factory import make_engine
        from pipelinerl_jax.tokenizer import get_tokenizer
        self.eval_every, self.total_steps = cfg.learner.eval_every, cfg.learner.total_steps
        self.engine = make_engine(eval_view(cfg), init_checkpoint, 0, workdir)  # version -1
        self.evaluator = Evaluator(cfg, self.engine, build_task(cfg),
                                   get_tokenizer(cfg.tokenizer))
        self.writer = MetricsWriter(workdir, EVAL_LOG, tb_suffix=".evaluator")
        self.evaluated = []
        self.describes = describes  # the run's WeightVersion description

    def put(self, version: int, flat) -> bool:
        """Evaluates `version` when it is due; returns whether it did."""
        if not due(version, self.eval_every, self.total_steps):
            return False
        self._evaluate(version, flat)
        return True

    def finish(self, version: int, flat) -> None:
        """The run ended at `version`: evaluated even when not due."""
        if not self.evaluated or self.evaluated[-1] != version:
            self._evaluate(version, flat)

    def _evaluate(self, version: int, flat) -> None:
        self.engine.update_weights(self.describes.carrying(version, tensors=flat), version,
                                   allow_older=version <= self.engine.version)
        metrics = self.evaluator.run(version)
        self.writer.write(version, {"version": version, **metrics})
        self.evaluated.append(version)

    def close(self) -> None:
        self.writer.close()
        self.evaluator.close()
        self.engine.close()
