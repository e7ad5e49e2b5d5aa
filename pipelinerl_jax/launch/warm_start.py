"""The checkpoint RL starts from; supervised training on the task's demonstrations if needed.

    ckpt = warm_start(cfg, workdir)

In order: `cfg.warm_start.checkpoint` when given (a model directory); `workdir/warm_start/model`
when an earlier attempt finished it; a new SFT run of `cfg.warm_start.steps` steps (or a
scratch model) in a child process (`roles.py`, role `sft`) on `workdir/warm_start/`, which
then holds `config.json` (what it trained from), `model/`, `sft_metrics.jsonl`,
`sft_summary.json` and `logs/sft.log`; otherwise the pretrained `cfg.model.path` as is.
The launcher calls it once per run; the ablation runner once per grid, for all its runs.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Callable, Optional

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.launch import roles
from pipelinerl_jax.launch.progress import SftProgress
from pipelinerl_jax.launch.supervisor import LaunchError, tail


def _say(message: str) -> None:
    print(message, flush=True)


def _is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def warm_start(cfg, workdir: str, *, progress: bool = True, env: Optional[dict] = None,
               timeout_s: Optional[float] = None, stopping: Optional[threading.Event] = None,
               log: Callable[[str], None] = _say) -> str:
    """Returns the checkpoint RL starts from (see the module docstring).

    `cfg`: a validated, resolved run config. `progress`: a progress bar while SFT runs.
    `env`: the SFT child's environment (None: this one's). `timeout_s`: SFT past it fails.
    `stopping`: once set, the SFT child is stopped and KeyboardInterrupt raised. Raises
    LaunchError when SFT fails and ConfigError when a given checkpoint is no model directory.
    """
    given = cfg.warm_start.checkpoint
    if given:
        if not _is_model_dir(given):
            raise ConfigError("warm_start.checkpoint",
                              f"{given!r} is not a model directory (no config.json)")
        return os.path.abspath(given)
    ws_dir = os.path.join(os.path.abspath(workdir), "warm_start")
    model = os.path.join(ws_dir, "model")
    if _is_model_dir(model):
        return model  # resuming: the warm start is done
    if not (cfg.warm_start.steps > 0 or cfg.model.init == "scratch"):
        return cfg.model.path
    os.makedirs(ws_dir, exist_ok=True)
    with open(os.path.join(ws_dir, "config.json"), "w") as f:
        f.write(cfg.to_json(indent=2))
    stale = os.path.join(ws_dir, "sft_metrics.jsonl")  # from an interrupted earlier attempt
    if os.path.exists(stale):
        os.remove(stale)

    child = roles.child("sft", ws_dir, env=env).start()
    target = cfg.warm_start.get("target_accuracy") or 0.0
    until = f", until held-out accuracy {target:.0%}" if target else ""
    log(f"warm start: {cfg.warm_start.steps} supervised steps{' at most' if target else ''}"
        f"{until} -> {model} (log: {child.log_path})")
    bar = SftProgress(ws_dir, cfg.warm_start.steps) if progress else None

    def every():
        if stopping is not None and stopping.is_set():
            raise KeyboardInterrupt
        if bar is not None:
            bar.update()
    code = -1
    try:
        code = child.wait(timeout_s, grace=cfg.launch.shutdown_timeout_s, every=every)
    finally:
        if bar is not None:
            bar.close(done=code == 0)
    if code != 0 or not _is_model_dir(model):
        raise LaunchError(f"warm start failed (exit {code}; log {child.log_path}):\n"
                          f"{tail(child.log_path)}")
    summary = os.path.join(ws_dir, "sft_summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            s = json.load(f)
        extra = f", held-out accuracy {s['eval/accuracy']:.3f}" if "eval/accuracy" in s else ""
        if s.get("stopped_at", s.get("steps")) != s.get("steps"):
            extra += f", stopped at step {s['stopped_at']}"
        if s.get("target_reached") is False:
            extra += " (target NOT reached)"
        log(f"warm start done in {s['time_s']:.0f}s (loss {s['final_loss']:.3f}{extra})")
    return model
