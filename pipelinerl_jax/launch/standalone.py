"""A role started on its own, without the launcher (roles on separate machines).

    python -m pipelinerl_jax.launch --role=worker --workdir=DIR --index=1 \\
        --config=configs/default.py --config.transport.queue_host=10.0.0.2 ...

`prepare` does for one role what the launcher does for a whole run: validates the config and
resolves it (the queue's staleness policy and limits, the transport's vocabulary), and checks
what only the launcher could otherwise fill in: fixed ports (0 means "the launcher picks") and
the checkpoint the learner and the workers start from (`--init_checkpoint`, else
`DIR/init_checkpoint.txt`, else `warm_start.checkpoint`, else a pretrained `model.path`;
the warm start itself is `experiments/sft.py`). The role's resolved config is kept as
`DIR/config.<name>.json`, a record of what it ran with.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

from pipelinerl_jax import run_config
from pipelinerl_jax.config_checks import ConfigError


def init_checkpoint(cfg, workdir: str, given: Optional[str]) -> str:
    """The model directory a standalone learner or worker starts from."""
    if given:
        path = given
    elif os.path.isfile(os.path.join(workdir, "init_checkpoint.txt")):
        with open(os.path.join(workdir, "init_checkpoint.txt")) as f:
            path = f.read().strip()
    elif cfg.warm_start.checkpoint:
        path = cfg.warm_start.checkpoint
    elif cfg.model.init == "hf" and cfg.model.path:
        path = cfg.model.path
    else:
        raise ConfigError("warm_start.checkpoint", "a role started on its own needs the model "
                          "it starts from: --init_checkpoint=DIR, warm_start.checkpoint or "
                          "model.path (a warm start: experiments/sft.py)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("warm_start.checkpoint", f"{path!r} is not a model directory "
                          "(no config.json)")
    return os.path.abspath(path)


def prepare(cfg, role: str, workdir: str, index: int = 0,
            given_init: Optional[str] = None) -> Tuple[object, Optional[str]]:
    """(resolved config, init checkpoint or None for the queue) of a standalone role."""
    run_config.validate(cfg)
    cfg = run_config.resolve(cfg)
    for key in ("queue_port", "weights_port"):
        if not cfg.transport[key]:
            raise ConfigError(f"transport.{key}", "0 lets the launcher pick a free port; "
                              "roles started on their own need the same fixed port")
    init = None if role in ("queue", "sft") else init_checkpoint(cfg, workdir, given_init)
    os.makedirs(workdir, exist_ok=True)
    name = {"worker": f"worker{index}",
            "learner": f"learner{os.environ.get('JAX_PROCESS_ID', '')}"}.get(role, role)
    with open(os.path.join(workdir, f"config.{name}.json"), "w") as f:
        f.write(cfg.to_json(indent=2))
    return cfg, init
