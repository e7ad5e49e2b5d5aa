"""The run config's `sglang` section: SGLang servers used when `sampler.kind='sglang'`.

`sglang_config()` gives the defaults, `validate_sglang_config` checks a section and raises one
`ConfigError` naming the key; `validate_run_config` is the 'sglang' row's check in
`rollout/factory.py` (servers are required only when the run samples from them).
"""
from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from pipelinerl_jax import config_checks as cfg_lib
from pipelinerl_jax.rollout.sglang_client import parse_url

PAUSE_MODES = ("retract", "in_place", "abort")
ABORT_POLICIES = ("resubmit", "drop")


def sglang_config() -> ml_collections.ConfigDict:
    """Defaults of the `sglang` config section (validated by `validate_sglang_config`)."""
    c = ml_collections.ConfigDict()
    c.urls = ()  # 'http://host:port' of every server; split among rollout workers
    # The evaluator role's own servers (held-out evaluation, learner.eval_every > 0): an
    # evaluation samples one version greedily, apart from the workers' refits.
    c.eval_urls = ()
    # The context the servers were launched with (--context-length): requests are bounded by
    # it. In a run config None = model.max_seq_len (run_config.resolve).
    c.max_seq_len = config_dict.placeholder(int)
    c.concurrency_per_server = 64  # samples in flight per server (routing limit)
    c.connect_timeout_s = 5.0
    c.request_timeout_s = 3600.0  # one /generate call (long generations)
    c.control_timeout_s = 600.0  # /pause_generation, /update_weights_from_disk, ...
    c.health_deadline_s = 600.0  # wait this long for /health at startup
    c.health_check_interval_s = 5.0  # re-probe servers that were removed
    c.max_retries = 5  # per HTTP call, for 502/503/504, connection errors and timeouts
    c.backoff_initial_s = 0.1  # retry k waits ~ initial * 2^k (jittered), at most backoff_max_s
    c.backoff_max_s = 5.0
    c.pause_mode = "retract"  # 'retract' | 'in_place' | 'abort' during a refit
    c.on_abort = "resubmit"  # 'resubmit' (prefix kept) | 'drop' (returned as 'abort')
    c.max_resubmits = 8  # per sample
    c.api_key = ""  # for servers started with --api-key
    return c


def validate_sglang_config(cfg, prefix: str = "sglang", *, required: bool = False,
                           num_workers: int = 1) -> None:
    """Raises `ConfigError` naming the first bad key; `required` when sampler.kind='sglang'."""
    k = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    root = cfg
    for part in reversed(prefix.split(".") if prefix else []):
        root = {part: root}
    cfg_lib.check_keys(cfg, prefix, sglang_config().keys())
    for name in ("urls", "eval_urls"):
        urls = cfg[name] if name in cfg else ()
        if isinstance(urls, str) or not isinstance(urls, (tuple, list)):
            raise cfg_lib.ConfigError(k(name), f"must be a tuple of 'http://host:port' "
                                               f"strings, got {urls!r}")
        for u in urls:
            try:
                parse_url(u)
            except (ValueError, TypeError, AttributeError) as e:
                raise cfg_lib.ConfigError(k(name), str(e)) from None
        if len(set(urls)) != len(urls):
            raise cfg_lib.ConfigError(k(name), f"lists a server twice: {tuple(urls)}")
    urls = cfg["urls"]
    shared = set(urls) & set(cfg["eval_urls"] if "eval_urls" in cfg else ())
    if shared:
        raise cfg_lib.ConfigError(k("eval_urls"), f"{sorted(shared)} also in {k('urls')}: the "
                                                  "evaluator needs servers of its own")
    if required and len(urls) < num_workers:
        raise cfg_lib.ConfigError(k("urls"), f"{len(urls)} server(s) for {num_workers} rollout "
                                             "worker(s) (sampler.kind='sglang'): each worker "
                                             "needs at least one server of its own")
    if cfg["max_seq_len"] is not None:
        cfg_lib.positive_int(root, k("max_seq_len"))
    for name in ("concurrency_per_server", "max_resubmits"):
        cfg_lib.positive_int(root, k(name), allow_zero=name == "max_resubmits")
    cfg_lib.positive_int(root, k("max_retries"), allow_zero=True)
    for name in ("connect_timeout_s", "request_timeout_s", "control_timeout_s",
                 "health_deadline_s", "health_check_interval_s", "backoff_initial_s",
                 "backoff_max_s"):
        cfg_lib.number(root, k(name), lo=0.0, lo_open=True)
    cfg_lib.one_of(root, k("pause_mode"), PAUSE_MODES)
    cfg_lib.one_of(root, k("on_abort"), ABORT_POLICIES)
    if not isinstance(cfg["api_key"], str):
        raise cfg_lib.ConfigError(k("api_key"), f"must be a string, got {cfg['api_key']!r}")


def validate_run_config(cfg, selected: bool) -> None:
    """The `sglang` section of run config `cfg`; `selected`: sampler.kind is 'sglang', so
    every rollout worker needs a server of its own."""
    validate_sglang_config(cfg.sglang, "sglang", required=selected,
                           num_workers=cfg.rollout.num_workers)
    every = cfg.learner.eval_every
    if selected and isinstance(every, int) and every > 0 and not cfg.sglang.eval_urls:
        raise cfg_lib.ConfigError("sglang.eval_urls", "held-out evaluation "
                                  f"(learner.eval_every={cfg.learner.eval_every}) samples on "
                                  "SGLang servers of its own: list them here, or set "
                                  "learner.eval_every=0")
