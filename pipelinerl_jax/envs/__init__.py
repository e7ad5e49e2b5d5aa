"""Multi-turn, tool-using environments (docs/environments.md).

    task = get_env_task(cfg.env)                        # an EnvTask (also a tasks.Task)
    runner = make_runner(cfg.env, engine, tokenizer)     # EpisodeRunner over any engine
    groups = GroupRunner(runner, group_size)            # whole groups of episodes, or a reason
    for g in groups.poll(timeout=0.02): ...              # GroupResult: episodes with loss masks

Modules: `base` (the interface: `Environment`, `EnvReply`, `ModelTurn`, `EnvTask`), `runner`
(`EpisodeRunner`, `Episode`), `groups` (`GroupRunner`, `run_group`, `GroupSampler`: dynamic
sampling), `tools` (the tool thread pool and reply checks), `calculator`, `kv_lookup`.

In a run config, `task.name` picks what is trained: a single-turn task (`tasks.REGISTRY`) or
an environment (`REGISTRY` here; the names are disjoint), whose keys then come from the run
config's `env` section (`build_task(cfg)`, `is_env_task(cfg)`); that section has no `name`.
The `env` section is flat like `task`: every environment's keys are present, only the
chosen one's are validated and used, and unknown keys are errors. Runner limits:
`max_turns` (0 = the task's default), `max_turn_tokens`, `max_episode_tokens` (0 = the
engine's `max_seq_len`), `max_env_tokens`, `tool_timeout_s`, `tool_threads`; and
`dynamic_sampling` (drop all-equal-reward groups, DAPO) for whoever samples the groups.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import ml_collections

from pipelinerl_jax import config_checks as cfglib
from pipelinerl_jax.envs import calculator, kv_lookup
from pipelinerl_jax.envs.base import (EnvReply, EnvTask, Environment, ModelTurn,
                                      encode_demonstration, final_answer_reply, last_line)
from pipelinerl_jax.envs.calculator import CalculatorTask
from pipelinerl_jax.envs.groups import (GroupResult, GroupRunner, GroupSampler, drop_reason,
                                        run_group)
from pipelinerl_jax.envs.kv_lookup import KVLookupTask
from pipelinerl_jax.envs.runner import Episode, EpisodeRunner, TurnRecord
from pipelinerl_jax import tasks
from pipelinerl_jax.tasks.base import Task, nested

__all__ = [
    "EnvReply", "EnvTask", "Environment", "ModelTurn", "encode_demonstration",
    "final_answer_reply", "last_line", "CalculatorTask", "KVLookupTask", "Episode",
    "EpisodeRunner", "TurnRecord", "GroupResult", "GroupRunner", "GroupSampler", "drop_reason",
    "run_group", "REGISTRY", "env_config", "get_env_task", "runner_options", "make_runner",
    "is_env_task", "build_task",
]

# name -> the environment's module: its `DEFAULTS` (its keys of the flat `env` section) and
# `from_config(env_section, prefix)`, which validates them and builds its `EnvTask`. Adding an
# environment is its module plus one line here (docs/extending.md).
REGISTRY: dict[str, ModuleType] = {
    "calculator": calculator,
    "kv_lookup": kv_lookup,
}
if set(REGISTRY) & set(tasks.REGISTRY):  # `task.name` must say unambiguously which it is
    raise ValueError(f"environment names {sorted(set(REGISTRY) & set(tasks.REGISTRY))} are "
                     "also single-turn task names")
RUNNER_DEFAULTS = {"max_turns": 0, "max_turn_tokens": 32, "max_episode_tokens": 0,
                   "max_env_tokens": 64, "tool_timeout_s": 10.0, "tool_threads": 16,
                   "dynamic_sampling": False}
_COMMON = {"name": "calculator", "truncated_reward": 0.0, "tool_latency_s": 0.0}


def _defaults() -> dict:
    """Every registered environment's keys at their defaults, plus the common and runner ones."""
    return tasks.merge_defaults({"common": _COMMON, "runner": RUNNER_DEFAULTS},
                                REGISTRY.values())


def env_config(name: str = "calculator", **overrides: Any) -> ml_collections.ConfigDict:
    """The flat `env` section with every key at its default; `overrides` replace defaults."""
    defaults = _defaults()
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise cfglib.ConfigError(f"env.{sorted(unknown)[0]}",
                                 f"unknown key; valid keys: {sorted(defaults)}")
    cfg = ml_collections.ConfigDict(defaults)
    cfg.name = name
    cfg.update(overrides)
    return cfg


def get_env_task(cfg: Any, prefix: str = "env") -> EnvTask:
    """Validates an `env_config()` section (runner keys included) and builds its task."""
    cfglib.check_keys(cfg, prefix, _defaults())
    name = cfglib.one_of(nested(prefix, cfg), f"{prefix}.name", sorted(REGISTRY))
    runner_options(cfg, prefix)
    return REGISTRY[name].from_config(cfg, prefix)


def runner_options(cfg: Any, prefix: str = "env") -> dict:
    """The `EpisodeRunner` keyword arguments of an `env` section (ConfigError names the key)."""
    c = nested(prefix, cfg)
    out = {k: cfglib.positive_int(c, f"{prefix}.{k}", allow_zero=k in ("max_turns",
                                                                       "max_episode_tokens"))
           for k in ("max_turns", "max_turn_tokens", "max_episode_tokens", "max_env_tokens",
                     "tool_threads")}
    out["tool_timeout_s"] = cfglib.number(c, f"{prefix}.tool_timeout_s", lo=0.0, lo_open=True)
    if not isinstance(cfglib.get(c, f"{prefix}.dynamic_sampling"), bool):
        raise cfglib.ConfigError(f"{prefix}.dynamic_sampling", "must be a bool")
    out["max_turns"] = out["max_turns"] or None
    out["max_episode_tokens"] = out["max_episode_tokens"] or None
    return out


def make_runner(cfg: Any, engine, tokenizer, task: EnvTask | None = None, prefix: str = "env",
                **sampling: Any) -> EpisodeRunner:
    """An `EpisodeRunner` for the `env` section; `sampling`: temperature, top_p, top_k."""
    task = task if task is not None else get_env_task(cfg, prefix)
    return EpisodeRunner(engine, tokenizer, task, **runner_options(cfg, prefix), **sampling)


def is_env_task(cfg: Any) -> bool:
    """Whether a run config's `task.name` names an environment (multi-turn episodes)."""
    return cfglib.get(cfg, "task.name") in REGISTRY


def build_task(cfg: Any) -> Task:
    """The task a run config trains (ConfigError names the key): the environment `task.name`
    configured by the `env` section (an `EnvTask`), or the single-turn task of `task`."""
    if not is_env_task(cfg):
        return tasks.get_task(cfg.task)
    cfglib.check_keys(cfg.task, "task", tasks.task_config().keys())
    section = dict(cfglib.get(cfg, "env"))
    if "name" in section:
        raise cfglib.ConfigError("env.name", "is not a run-config key: task.name picks the "
                                 "environment")
    return get_env_task({**section, "name": cfg.task.name})
