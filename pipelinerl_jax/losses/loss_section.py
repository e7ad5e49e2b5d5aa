"""The `loss` section of an experiment config (ml_collections) and building a loss from it.

    config.loss = loss_config()       # in get_config()
    --config.loss.name=tis --config.loss.cap=2.0      # on the command line

Every hyperparameter of every loss is a typed placeholder: None means "that loss's default",
so one section serves all losses, and a hyperparameter set for a loss that does not take it
fails (`loss.cap: is not a hyperparameter of loss 'ppo'; ...`) instead of being ignored.
"""
from __future__ import annotations

from typing import Any, Callable

import ml_collections
from ml_collections import config_dict

from pipelinerl_jax.config_checks import ConfigError, check_keys
from pipelinerl_jax.losses.registry import (AGG_HPARAMS, KL_HPARAMS, LOSSES, get_loss,
                                            resolve_hparams)


def _all_hparams() -> dict:
    """name -> placeholder type, over every loss (a name has one type everywhere)."""
    types = {}
    for spec in LOSSES.values():
        for key, p in {**spec.hparams, **AGG_HPARAMS}.items():
            assert types.setdefault(key, p.type) is p.type, f"{key} has two types"
    return types


def loss_config() -> ml_collections.ConfigDict:
    """The `loss` section: `name` ('reinforce'), `kl_coef` (0.0), `kl_estimator` ('k3') and a
    None placeholder of the right type for `agg`, `max_tokens` and every loss hyperparameter."""
    cfg = ml_collections.ConfigDict()
    cfg.name = "reinforce"
    cfg.kl_coef = KL_HPARAMS["kl_coef"].default
    cfg.kl_estimator = KL_HPARAMS["kl_estimator"].default
    for key, kind in sorted(_all_hparams().items()):
        cfg[key] = config_dict.placeholder(kind)
    return cfg


def _hparams(cfg: Any) -> tuple[str, dict]:
    allowed = {"name", "kl_coef", "kl_estimator", *_all_hparams()}
    check_keys(cfg, "loss", allowed)
    if "name" not in cfg:
        raise ConfigError("loss.name", f"is missing; valid: {sorted(LOSSES)}")
    hparams = {k: cfg[k] for k in cfg.keys() if k != "name" and cfg[k] is not None}
    return cfg["name"], hparams


def validate_loss_config(cfg: Any) -> dict:
    """Checks a `loss` section without building anything; returns the resolved hyperparameters
    (defaults filled in). Raises ConfigError naming the key."""
    name, hparams = _hparams(cfg)
    return resolve_hparams(name, **hparams)


def loss_from_config(cfg: Any) -> Callable:
    """`get_loss(cfg.name, **{every hyperparameter of cfg that is not None})`."""
    name, hparams = _hparams(cfg)
    return get_loss(name, **hparams)
