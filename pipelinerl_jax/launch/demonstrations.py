"""The warm start's data: a task's demonstrations encoded as the learner's advantage-1 rollouts.

Supervised warm start is the `reinforce` loss with advantage 1 on every completion token
(`learner.sft`); this module turns what a task demonstrates into those tokens. For a plain
task a demonstration is a prompt and a target completion. For an environment
(`envs.EnvTask`) it is a whole correct episode laid out as the runner lays it out
(`envs.encode_demonstration`): tool replies are in the sequence as context but masked out of
the loss, so the warm start never learns to write them itself. The learner never sees a task
or an environment, only these token rows.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from pipelinerl_jax.envs import EnvTask, build_task, encode_demonstration
from pipelinerl_jax.learner.sft import run_sft
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.records import Rollout


def demo_rollouts(task, tok, seed: int) -> Iterator[Rollout]:
    """An endless stream of demonstrations as advantage-1 rollouts (module docstring)."""
    for problem, target in task.demonstrations(seed):
        mask = None
        if isinstance(task, EnvTask):
            prompt, completion, mask = encode_demonstration(task, tok, problem)
        else:
            prompt = np.asarray(tok.encode_prompt(problem.prompt), np.int32)
            completion = np.asarray(tok.encode_completion(target), np.int32)
        zeros_i = np.zeros(len(completion), np.int32)
        yield Rollout(prompt_ids=prompt, completion_ids=completion,
                      logp_behaviour=np.zeros(len(completion), np.float32),
                      version=zeros_i, kv_version=zeros_i, reward=1.0, advantage=1.0,
                      group_id=problem.id, group_size=1, loss_mask=mask)


def sft_on_demonstrations(cfg, workdir: str, progress: bool = True, evaluate=None) -> dict:
    """`learner.sft.run_sft` on the demonstrations of `cfg`'s task (seeded by `cfg.seed`):
    the warm start's SFT run. Returns run_sft's summary."""
    tok = get_tokenizer(cfg.tokenizer)
    demos = demo_rollouts(build_task(cfg), tok, cfg.seed)
    return run_sft(cfg, workdir, demos, tok, progress=progress, evaluate=evaluate)
