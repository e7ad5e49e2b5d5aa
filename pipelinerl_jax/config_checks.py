"""Config validation helpers shared by every part of the codebase.

Every check raises `ConfigError` whose message starts with the dotted key that is wrong,
e.g. ``ConfigError("learner.batch_size: must be a positive integer, got 0")``, so a user
sees exactly which ``--config.a.b=...`` flag to fix. Sections validate themselves with these
helpers; `experiments/` and `launch/` call the section validators before any process starts.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping


class ConfigError(ValueError):
    """An invalid configuration value. The message names the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def get(cfg: Any, key: str) -> Any:
    """Reads dotted `key` from a ConfigDict / mapping; a missing key is a ConfigError."""
    node = cfg
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            raise ConfigError(key, "is missing from the config") from None
    return node


def check_keys(cfg: Mapping, prefix: str, allowed: Iterable[str]) -> None:
    """Fails on keys of `cfg` not in `allowed` (typos must not be silently ignored)."""
    allowed = set(allowed)
    for k in cfg.keys():
        if k not in allowed:
            raise ConfigError(f"{prefix}.{k}" if prefix else k,
                              f"unknown key; valid keys: {sorted(allowed)}")


def positive_int(cfg: Any, key: str, allow_zero: bool = False) -> int:
    v = get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (v == 0 and not allow_zero):
        raise ConfigError(key, f"must be a {'non-negative' if allow_zero else 'positive'} "
                               f"integer, got {v!r}")
    return v


def number(cfg: Any, key: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, allow_none: bool = False) -> float | None:
    v = get(cfg, key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(key, f"must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ConfigError(key, f"must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise ConfigError(key, f"must be <= {hi}, got {v!r}")
    return v


def one_of(cfg: Any, key: str, choices: Iterable[Any]) -> Any:
    v = get(cfg, key)
    choices = list(choices)
    if v not in choices:
        raise ConfigError(key, f"must be one of {choices}, got {v!r}")
    return v
