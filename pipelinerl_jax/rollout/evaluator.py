"""Held-out evaluation: greedy accuracy on the task's eval problems, sampled by an engine.
For an environment (`envs.EnvTask`) the accuracy is held-out episode success: greedy
episodes run by an `EpisodeRunner` with the run's `env` limits, plus turns per episode and
the fraction of each end reason.

Two users. The evaluator role (`rollout/eval_role.py`) evaluates a run's versions off the
learner's step, with an engine of the run's own backend (`eval_view` + the backend factory).
The warm start and the replay tool evaluate a model in their own process with an embedded
`JaxEngine` (`Evaluator.embedded`).
"""
from __future__ import annotations

import time
from typing import Optional

import ml_collections
import numpy as np

from pipelinerl_jax.envs import EnvTask, build_task, make_runner
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.records import GenerationRequest, SamplingParams


def eval_slots(cfg) -> int:
    """Sequences an evaluation engine decodes at once: the eval set, within [8, 64]."""
    return min(64, max(8, cfg.learner.eval_size))


def eval_view(cfg):
    """The run config as the evaluation engine sees it: an engine of the run's backend
    (`sampler.kind`) sized for the eval set, with no KV reservation for long rollouts; for
    'sglang' the servers of `sglang.eval_urls`, as one worker's. It serves what the run
    publishes (LoRA: adapters on the base)."""
    view = ml_collections.ConfigDict(cfg.to_dict())
    view.engine.max_slots = eval_slots(cfg)
    view.engine.kv_budget_tokens = 0
    view.rollout.num_workers = 1
    if cfg.sampler.kind == "sglang":
        view.sglang.urls, view.sglang.eval_urls = tuple(cfg.sglang.eval_urls), ()
    return view


class Evaluator:
    """`evaluator.run(version)` -> `eval/accuracy`, `eval/response_length_mean`, `eval/time_s`
    (environments: also `eval/turns_mean`, `eval/end_<reason>`) over `learner.eval_size`
    held-out problems, decoded greedily by `engine` with the weights it holds.

    `engine`: any `InferenceEngine` (started when the task is an environment: the episode
    runner submits and polls). The caller installs the weights (`engine.update_weights`)."""

    def __init__(self, cfg, engine, task, tok, *, owns_engine: bool = False):
        self.task, self.tok, self.engine, self.owns_engine = task, tok, engine, owns_engine
        self.problems = task.eval_problems(cfg.learner.eval_size)
        self.max_new_tokens = cfg.sampling.max_new_tokens
        self.runner = None
        if isinstance(task, EnvTask):
            self.runner = make_runner(cfg.env, engine, tok, task=task, temperature=0.0)

    @classmethod
    def embedded(cls, cfg, model, task, tok) -> "Evaluator":
        """An evaluator over its own `JaxEngine` holding `model` (a `Decoder` or a checkpoint
        path) as version 0; `close()` closes that engine too."""
        engine_cfg = dict(cfg.engine)
        engine_cfg.update(max_slots=eval_slots(cfg), kv_budget_tokens=0)
        engine = JaxEngine(model, engine_cfg, version=0, engine_id="eval")
        if isinstance(task, EnvTask):
            engine.start()
        return cls(cfg, engine, task, tok, owns_engine=True)

    def __call__(self, params_flat, version: int) -> dict:
        """Installs `params_flat` as `version` (unless the engine holds it) and evaluates."""
        if version != self.engine.version:
            self.engine.update_weights(params_flat, version)
        return self.run(version)

    def run(self, version: int) -> dict:
        """Evaluates the engine's current weights (`version` names the requests)."""
        if self.runner is not None:
            return self._episodes()
        t0 = time.time()
        correct, lengths = self.correct(version)
        return {"eval/accuracy": float(np.mean(correct)),
                "eval/response_length_mean": float(np.mean(lengths)),
                "eval/time_s": time.time() - t0}

    def correct(self, version: int):
        """(correct, response lengths): one entry per held-out problem, in the set's order,
        from greedy completions of the engine's current weights (single-turn tasks)."""
        reqs = [GenerationRequest(f"eval-{version}-{i}",
                                  np.asarray(self.tok.encode_prompt(p.prompt), np.int32),
                                  SamplingParams(max_new_tokens=self.max_new_tokens,
                                                 temperature=0.0,
                                                 stop_token_ids=(self.tok.eos_id,)))
                for i, p in enumerate(self.problems)]
        outs = self.engine.generate(reqs)
        correct = np.array([self.task.reward(p, self.tok.decode(c.token_ids, stop_at_eos=True),
                                             c.finish_reason).correct
                            for p, c in zip(self.problems, outs)], bool)
        return correct, np.array([len(c.token_ids) for c in outs])

    def _episodes(self) -> dict:
        t0 = time.time()
        eps = self.runner.run(self.problems, seeds=list(range(len(self.problems))))
        out = {"eval/accuracy": float(np.mean([e.correct for e in eps])),
               "eval/response_length_mean": float(np.mean([len(e.completion_ids) for e in eps])),
               "eval/turns_mean": float(np.mean([len(e.turns) for e in eps])),
               "eval/time_s": time.time() - t0}
        for reason in sorted({e.end_reason for e in eps}):
            out[f"eval/end_{reason}"] = float(np.mean([e.end_reason == reason for e in eps]))
        return out

    def close(self):
        if self.runner is not None:
            self.runner.close()
        if self.owns_engine:
            self.engine.close()


def embedded_evaluator(cfg, init_checkpoint: str) -> Optional[Evaluator]:
    """An in-process evaluator starting from `init_checkpoint` (version 0), or None when
    `learner.eval_every` is 0: the replay tool's (experiments/replay.py)."""
    if cfg.learner.eval_every <= 0:
        return None
    return Evaluator.embedded(cfg, init_checkpoint, build_task(cfg), get_tokenizer(cfg.tokenizer))
