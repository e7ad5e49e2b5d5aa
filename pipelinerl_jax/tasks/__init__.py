"""Tasks with verifiable rewards, and the registry that builds one from the `task` config.

Built in (``task.name``):
  reverse, copy, sort  synthetic strings with lognormal lengths (`synthetic.py`)
  countdown            reach a target with + - * / over given numbers (`countdown.py`)
  add                  the sum of a few whole numbers, no scratchpad (`arithmetic.py`)
  gsm8k                math word problems from a local GSM8K-format JSONL (`gsm8k.py`)

The `task` section is flat: every task's keys are present (so ``--config.task.name=countdown``
works on any config file) and only the chosen task's keys are validated and used. Unknown
keys are errors, so typos never pass silently.

    task = get_task(cfg.task)            # validates; ConfigError names e.g. 'task.median_length'
    for problem in task.problems(seed):  # endless, deterministic per seed
        ...
        result = task.reward(problem, text, finish_reason)   # never raises
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable

import ml_collections

from pipelinerl_jax import config_checks as cfglib
from pipelinerl_jax.tasks import arithmetic, countdown, gsm8k, synthetic
from pipelinerl_jax.tasks.base import (HELD_OUT_MODULUS, GeneratedTask, Problem, RewardResult,
                                       Task, is_held_out, nested, stable_hash)
from pipelinerl_jax.tasks.arithmetic import AdditionTask
from pipelinerl_jax.tasks.countdown import CountdownTask
from pipelinerl_jax.tasks.gsm8k import GSM8KTask
from pipelinerl_jax.tasks.synthetic import SyntheticStringTask

__all__ = [
    "HELD_OUT_MODULUS", "GeneratedTask", "Problem", "RewardResult", "Task", "is_held_out",
    "stable_hash", "AdditionTask", "CountdownTask", "GSM8KTask", "SyntheticStringTask", "REGISTRY",
    "task_config", "get_task", "validate_task_config", "merge_defaults",
]

# name -> the task's module: its `DEFAULTS` (its keys of the flat `task` section) and
# `from_config(name, task_section, prefix)`, which validates them and builds the task. Adding a
# task is its module plus one line here (docs/extending.md).
REGISTRY: dict[str, ModuleType] = {
    **{variant: synthetic for variant in synthetic.VARIANTS},
    "countdown": countdown,
    "add": arithmetic,
    "gsm8k": gsm8k,
}
_COMMON = {"name": "reverse", "truncated_reward": 0.0}


def merge_defaults(parts: dict, modules: Iterable[ModuleType] = ()) -> dict:
    """One flat defaults dict from `parts` (`{owner: defaults}`) and each of `modules`' (a
    registry's values) `DEFAULTS`, owned by the module's name.

    Two owners may share a key only with the same default: otherwise whichever came last
    would silently decide the other task's default, so that is an error at import time."""
    parts = dict(parts)
    for module in modules:
        parts.setdefault(module.__name__.rsplit(".", 1)[-1], module.DEFAULTS)
    merged: dict = {}
    owner_of: dict = {}
    for owner, defaults in parts.items():
        for key, value in defaults.items():
            if key in merged and merged[key] != value:
                raise ValueError(f"task default {key!r} collides: {owner_of[key]} sets "
                                 f"{merged[key]!r}, {owner} sets {value!r}; rename one")
            merged.setdefault(key, value)
            owner_of.setdefault(key, owner)
    return merged


def _defaults() -> dict:
    """Every registered task's keys at their defaults, plus the common ones."""
    return merge_defaults({"common": _COMMON}, REGISTRY.values())


def task_config(name: str = "reverse", **overrides: Any) -> ml_collections.ConfigDict:
    """The flat `task` section with every key at its default; `overrides` replace defaults.

    Common keys: `name`, `truncated_reward` (reward of a completion that ended without EOS).
    reverse/copy/sort: `median_length`, `p99_length`, `min_length`, `max_length`,
    `partial_credit` ('none' | 'prefix'). countdown: `num_numbers`, `max_operand`,
    `max_target`, `use_all_numbers`. add: `terms`, `digits`, `digit_order`. gsm8k: `path`, `eval_path`, `eval_size`,
    `prompt_template`, `max_completion_tokens`.
    """
    defaults = _defaults()
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise cfglib.ConfigError(f"task.{sorted(unknown)[0]}",
                                 f"unknown key; valid keys: {sorted(defaults)}")
    cfg = ml_collections.ConfigDict(defaults)
    cfg.name = name
    cfg.update(overrides)
    return cfg


def get_task(cfg: Any, prefix: str = "task") -> Task:
    """Validates a `task_config()` section and builds its task (ConfigError names the key)."""
    cfglib.check_keys(cfg, prefix, _defaults())
    name = cfglib.one_of(nested(prefix, cfg), f"{prefix}.name", sorted(REGISTRY))
    return REGISTRY[name].from_config(name, cfg, prefix)


def validate_task_config(cfg: Any, prefix: str = "task") -> None:
    """Fails early with a ConfigError naming the key; for gsm8k this also reads the files."""
    get_task(cfg, prefix)
