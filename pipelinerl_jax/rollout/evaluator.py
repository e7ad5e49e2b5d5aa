"""Held-out evaluation: greedy accuracy on the task's eval problems, with an embedded
`JaxEngine` holding the weights to evaluate. For an environment (`envs.EnvTask`) the
accuracy is held-out episode success: greedy episodes run by an `EpisodeRunner` with the run's
`env` limits, plus turns per episode and the fraction of each end reason.

The launcher builds one for the learner (`learner_evaluator`) and hands it in as a callable
`evaluate(params_flat, version) -> metrics`, so the learner never imports an engine; the
warm start evaluates its model the same way.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from pipelinerl_jax.envs import EnvTask, build_task, make_runner
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.tokenizers import get_tokenizer
from pipelinerl_jax.types import GenerationRequest, SamplingParams


class Evaluator:
    """`evaluator(params_flat, version)` -> `eval/accuracy`, `eval/response_length_mean`,
    `eval/time_s` over `learner.eval_size` held-out problems, decoded greedily.

    `model`: a `Decoder` or a checkpoint path, the engine's initial weights (version 0).
    """

    def __init__(self, cfg, model, task, tok):
        self.task, self.tok = task, tok
        self.problems = task.eval_problems(cfg.learner.eval_size)
        engine_cfg = dict(cfg.engine)
        engine_cfg.update(max_slots=min(64, max(8, cfg.learner.eval_size)), kv_budget_tokens=0)
        self.engine = JaxEngine(model, engine_cfg, version=0, engine_id="eval")
        self.max_new_tokens = cfg.sampling.max_new_tokens
        self.runner = None
        if isinstance(task, EnvTask):
            self.runner = make_runner(cfg.env, self.engine, tok, task=task, temperature=0.0)
            self.engine.start()  # the runner submits and polls; the loop thread generates

    def __call__(self, params_flat, version: int) -> dict:
        if version != self.engine.version:
            self.engine.update_weights(params_flat, version)
        if self.runner is not None:
            return self._episodes()
        reqs = [GenerationRequest(f"eval-{version}-{i}",
                                  np.asarray(self.tok.encode_prompt(p.prompt), np.int32),
                                  SamplingParams(max_new_tokens=self.max_new_tokens,
                                                 temperature=0.0,
                                                 stop_token_ids=(self.tok.eos_id,)))
                for i, p in enumerate(self.problems)]
        t0 = time.time()
        outs = self.engine.generate(reqs)
        correct = [self.task.reward(p, self.tok.decode(c.token_ids, stop_at_eos=True),
                                    c.finish_reason).correct
                   for p, c in zip(self.problems, outs)]
        return {"eval/accuracy": float(np.mean(correct)),
                "eval/response_length_mean": float(np.mean([len(c.token_ids) for c in outs])),
                "eval/time_s": time.time() - t0}

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
        self.engine.close()


def learner_evaluator(cfg, init_checkpoint: str) -> Optional[Evaluator]:
    """The learner's evaluator (its engine starts from `init_checkpoint`, which is version
    0), or None when `learner.eval_every` is 0."""
    if cfg.learner.eval_every <= 0:
        return None
    return Evaluator(cfg, init_checkpoint, build_task(cfg), get_tokenizer(cfg.tokenizer))
