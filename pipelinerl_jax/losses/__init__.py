"""Swappable policy losses (off-policy corrections), advantage estimators and staleness
diagnostics.

    loss_fn = get_loss("tis", cap=2.0)            # or loss_from_config(config.loss)
    loss, metrics = loss_fn(LossInputs(logp, logp_behaviour, logp_proximal, advantages,
                                       loss_mask, lag))

Formulas and defaults: DESIGN.md, "Loss specification"; each loss's docstring in `policy`.
"""
from pipelinerl_jax.losses.advantages import (ESTIMATORS, GroupAdvantages, advantage_config,
                                              advantages_from_config, baseline_advantages,
                                              compute_advantages, validate_advantage_config)
from pipelinerl_jax.losses.loss_section import loss_config, loss_from_config, validate_loss_config
from pipelinerl_jax.losses.core import AGGREGATIONS, KL_ESTIMATORS, MAX_LOG_RATIO, LossInputs
from pipelinerl_jax.losses.diagnostics import (LAG_BUCKETS, TOKEN_METRICS, flatten_metrics,
                                               off_policy_diagnostics)
from pipelinerl_jax.losses.registry import (LOSSES, get_loss, hparams_of, needs_proximal,
                                            resolve_hparams)

__all__ = [
    "AGGREGATIONS", "ESTIMATORS", "KL_ESTIMATORS", "LAG_BUCKETS", "LOSSES", "MAX_LOG_RATIO",
    "TOKEN_METRICS", "GroupAdvantages", "LossInputs", "advantage_config",
    "advantages_from_config", "baseline_advantages", "compute_advantages", "flatten_metrics",
    "get_loss", "hparams_of", "loss_config", "loss_from_config", "needs_proximal",
    "off_policy_diagnostics", "resolve_hparams", "validate_advantage_config",
    "validate_loss_config",
]
