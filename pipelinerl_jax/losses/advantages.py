"""Group advantage estimators (NumPy, run by the rollout worker on one prompt's samples).

For the G rewards R of one group (samples of one prompt):
  grpo     (R_i - mean R) / (std R + 1e-6), population std (Shao et al. 2024, DeepSeekMath);
  dr_grpo  R_i - mean R: no std division, which biases towards easy/hard prompts (Dr. GRPO,
           Liu et al. 2025, "Understanding R1-Zero-like training");
  rloo     R_i - mean of the other G-1 rewards (Ahmadian et al. 2024, "Back to basics").

Options a practitioner expects:
  drop_zero_variance  a group whose rewards are all equal (all correct / all wrong) has zero
                      advantage everywhere, so it carries no gradient but costs a step's compute:
                      `keep=False` tells the worker to skip it (DAPO's dynamic sampling, Yu et al.
                      2025).
  overlong='penalty'  DAPO's soft overlong punishment added to the reward, with L_max =
                      max_length and L_cache = overlong_buffer:
                        0 if L ≤ L_max - L_cache;  (L_max - L_cache - L) / L_cache up to L_max;
                        -1 beyond; times overlong_penalty.
  overlong='filter'   truncated samples (`truncated`, else length ≥ max_length) are not trained
                      on (`sample_mask` False, advantage 0) and leave the group statistics, since
                      a cut-off answer's reward says little about the policy (DAPO).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import ml_collections
import numpy as np
from ml_collections import config_dict

from pipelinerl_jax.config_checks import ConfigError, check_keys

ESTIMATORS = ("grpo", "dr_grpo", "rloo")
OVERLONG = ("none", "penalty", "filter")
GRPO_STD_EPS = 1e-6


class GroupAdvantages(NamedTuple):
    advantages: np.ndarray  # float32 [G]; 0 where sample_mask is False or keep is False
    rewards: np.ndarray  # float64 [G], after overlong shaping: what the advantages come from
    sample_mask: np.ndarray  # bool [G]; False = do not train on this sample
    keep: bool  # False = skip the whole group (zero variance, or no sample left)


def baseline_advantages(rewards: np.ndarray, estimator: str = "grpo") -> np.ndarray:
    """The plain estimator over one group's rewards [G] -> float64 advantages [G]."""
    r = np.asarray(rewards, np.float64)
    if estimator == "grpo":
        return (r - r.mean()) / (r.std() + GRPO_STD_EPS)
    if estimator == "dr_grpo":
        return r - r.mean()
    if estimator == "rloo":
        if r.size < 2:  # no other sample to form a baseline from
            return np.zeros_like(r)
        return r - (r.sum() - r) / (r.size - 1)
    raise ConfigError("advantage.estimator", f"must be one of {list(ESTIMATORS)}, "
                                             f"got {estimator!r}")


def overlong_penalty_term(lengths: np.ndarray, max_length: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment R_length(L) ∈ [-1, 0] (Yu et al. 2025, eq. 13)."""
    lengths = np.asarray(lengths, np.float64)
    start = max_length - buffer
    return np.where(lengths <= start, 0.0,
                    np.where(lengths <= max_length, (start - lengths) / buffer, -1.0))


def _check_options(estimator, overlong, overlong_buffer, overlong_penalty, max_length):
    if estimator not in ESTIMATORS:
        raise ConfigError("advantage.estimator",
                          f"must be one of {list(ESTIMATORS)}, got {estimator!r}")
    if overlong not in OVERLONG:
        raise ConfigError("advantage.overlong", f"must be one of {list(OVERLONG)}, "
                                                f"got {overlong!r}")
    if overlong == "penalty":
        if not isinstance(overlong_buffer, int) or isinstance(overlong_buffer, bool) \
                or overlong_buffer < 1:
            raise ConfigError("advantage.overlong_buffer", "overlong='penalty' needs a positive "
                                                           f"integer, got {overlong_buffer!r}")
        if max_length is not None and overlong_buffer > max_length:
            raise ConfigError("advantage.overlong_buffer",
                              f"{overlong_buffer} exceeds max_length={max_length}")
    if isinstance(overlong_penalty, bool) or not isinstance(overlong_penalty, (int, float)) \
            or not math.isfinite(overlong_penalty) or overlong_penalty < 0:
        raise ConfigError("advantage.overlong_penalty",
                          f"must be a finite number >= 0, got {overlong_penalty!r}")


def compute_advantages(rewards: np.ndarray, estimator: str = "grpo", *,
                       drop_zero_variance: bool = False, overlong: str = "none",
                       lengths: Optional[np.ndarray] = None, max_length: Optional[int] = None,
                       truncated: Optional[np.ndarray] = None,
                       overlong_buffer: Optional[int] = None,
                       overlong_penalty: float = 1.0) -> GroupAdvantages:
    """Advantages of one group of samples of one prompt (see the module docstring).

    rewards [G]; lengths [G] completion lengths and max_length (the sampling limit) for the
    overlong options; truncated [G] bool (finish_reason == 'length'), which overlong='filter'
    uses when given instead of lengths >= max_length.
    """
    _check_options(estimator, overlong, overlong_buffer, overlong_penalty, max_length)
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size == 0 or not np.all(np.isfinite(r)):
        raise ValueError(f"rewards: must be a non-empty 1-D array of finite numbers, got {r!r}")
    g = r.size

    def per_sample(name, value, dtype):
        a = np.asarray(value, dtype)
        if a.shape != (g,):
            raise ValueError(f"{name}: must have shape ({g},) like rewards, got {a.shape}")
        return a

    mask = np.ones(g, bool)
    if overlong != "none":
        if overlong == "penalty" or truncated is None:
            if lengths is None or max_length is None:
                raise ConfigError("advantage.overlong", f"{overlong!r} needs the completion "
                                                        f"lengths and max_length")
            lengths = per_sample("lengths", lengths, np.int64)
        if overlong == "penalty":
            r = r + overlong_penalty * overlong_penalty_term(lengths, max_length, overlong_buffer)
        elif truncated is not None:
            mask = ~per_sample("truncated", truncated, bool)
        else:
            mask = lengths < max_length

    advantages = np.zeros(g, np.float64)
    kept = r[mask]
    keep = kept.size > 0 and not (drop_zero_variance and np.ptp(kept) == 0.0)
    if keep:
        advantages[mask] = baseline_advantages(kept, estimator)
    return GroupAdvantages(advantages.astype(np.float32), r, mask, bool(keep))


def advantage_config() -> ml_collections.ConfigDict:
    """The `advantage` section: estimator, drop_zero_variance and the overlong handling."""
    cfg = ml_collections.ConfigDict()
    cfg.estimator = "grpo"
    cfg.drop_zero_variance = False
    cfg.overlong = "none"
    cfg.overlong_buffer = config_dict.placeholder(int)
    cfg.overlong_penalty = 1.0
    return cfg


def validate_advantage_config(cfg, max_length: Optional[int] = None) -> None:
    """Raises ConfigError naming the key; `max_length` (the sampling limit) when known."""
    check_keys(cfg, "advantage", advantage_config().keys())
    if not isinstance(cfg.get("drop_zero_variance", False), bool):
        raise ConfigError("advantage.drop_zero_variance",
                          f"must be a bool, got {cfg['drop_zero_variance']!r}")
    _check_options(cfg.get("estimator", "grpo"), cfg.get("overlong", "none"),
                   cfg.get("overlong_buffer"), cfg.get("overlong_penalty", 1.0), max_length)


def advantages_from_config(cfg, rewards: np.ndarray, *, lengths=None, max_length=None,
                           truncated=None) -> GroupAdvantages:
    """`compute_advantages` with the options of an `advantage` config section."""
    validate_advantage_config(cfg, max_length)
    options = {k: cfg[k] for k in cfg.keys() if k != "estimator"}
    return compute_advantages(rewards, cfg.get("estimator", "grpo"), lengths=lengths,
                              max_length=max_length, truncated=truncated, **options)
