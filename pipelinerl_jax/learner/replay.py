"""Replay: a fresh learner trained on a recorded run's batches (`recording.py`), in order.

    run_replay(cfg, "runs/async_lag4", "runs/replay_ppo", evaluate=...)

Corrections compared on identical stale data from a real pipeline: the recorded batches keep
their behaviour log-probs, advantages and per-token lags; the loss (and any other learner
setting in `cfg`) may differ. The learner starts from the recording's initial checkpoint (the
run's warm start, named in `recorded/meta.json`) with a fresh optimizer and trains step s on
the arrays recorded at step s through the same jitted step (`loop.make_step`), so a replay with
the recording's own config reproduces its loss metrics (the oracle that replay is exact).

What diverges, by design: with another loss the replayed policy at step s is not the policy the
recording's learner had, so the data is "off-policy" by more than its recorded lag says. The
`lag` the loss sees stays the recorded one, `recorded version at train time - behaviour
version`: how many of the *recording's* updates lay between sampling and training, a property
of the data, not a distance to the replayed policy. The true distance shows in the importance
ratios (`loss/ess`, `loss/kl_*`), which compare the replayed policy with the recorded
behaviour log-probs.

`metrics.jsonl` has the keys of a normal run where they mean something: `loss/*` and
`learner/*` of the replayed step, the recorded batch's data metrics (`reward/mean`, `lag/*`,
`rollout/*`, ...) copied from the recording, and `eval/*` every `learner.eval_every` steps
from the greedy evaluation a run's evaluator role does (here in-process: the `evaluate`
callable, `rollout.evaluator.embedded_evaluator`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable, Optional

import jax

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.learner import multihost, recording, train_step as ts
from pipelinerl_jax.learner.loop import make_step
from pipelinerl_jax.losses import flatten_metrics
from pipelinerl_jax.models import flat_params, from_pretrained

log = logging.getLogger(__name__)

# Metrics of the recorded batch (its data), copied into the replay's rows unchanged.
DATA_KEYS = ("reward/", "accuracy", "rollout/", "lag/", "kv_lag/", "start_lag/", "episode/",
             "learner/tokens", "learner/pack_fill")
# Config keys that change what a replayed step computes (reported when they differ).
COMPARED = ("loss", "learner.minibatches", "learner.micro_batches", "learner.optimizer",
            "learner.recompute_proximal", "sampling.temperature", "model.dtype",
            "model.param_dtype", "tokenizer", "mesh.shape")


def config_differences(recorded: dict, cfg: dict) -> dict:
    """{dotted key: [recorded value, replay value]} over `COMPARED` (the replay's intended
    change, e.g. `loss.name`, and any accidental one)."""
    def get(tree, key):
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    def flat(value, key, out):
        if isinstance(value, dict):
            for k, v in value.items():
                flat(v, f"{key}.{k}", out)
        else:
            out[key] = list(value) if isinstance(value, tuple) else value
        return out
    out = {}
    for key in COMPARED:
        a, b = flat(get(recorded, key), key, {}), flat(get(cfg, key), key, {})
        out.update({k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k)})
    return out


def run_replay(cfg, recording_path: str, workdir: str, init_checkpoint: Optional[str] = None,
               *, evaluate: Optional[Callable[[dict, int], dict]] = None) -> dict:
    """Trains on the recorded batches of `recording_path` (a run directory or its
    `recorded/`), at most `learner.total_steps` of them; writes `workdir/metrics.jsonl` and
    `workdir/replay.json`. `init_checkpoint` overrides the recording's. Returns the summary."""
    L = cfg.learner
    directory = recording.recording_dir(recording_path)
    meta = recording.read_meta(directory)
    index = recording.read_index(directory)[:L.total_steps]
    init = init_checkpoint or meta["init_checkpoint"]
    differences = config_differences(meta.get("config", {}), cfg.to_dict())

    # ------------------------------------------------------------------ mesh, model, step
    multihost.check_mesh(cfg.mesh.shape)
    mesh = sharding_lib.make_mesh(tuple(cfg.mesh.shape))
    model = from_pretrained(init, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                            mesh=mesh)
    optimizer, schedule = ts.make_optimizer(L.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    step_fn = make_step(cfg, model, optimizer, mesh, state)
    chunks, divisor = L.minibatches * L.micro_batches, sharding_lib.batch_divisor(mesh)

    # ------------------------------------------------------------------ outputs
    files = multihost.primary_or(lambda: multihost.RunFiles(workdir), multihost.Silent())
    summary = {"recording": os.path.abspath(directory), "init_checkpoint": init,
               "loss": cfg.loss.name, "recorded_steps": len(index),
               "config_differences": differences}
    for key, (was, now) in differences.items():
        log.info("replay differs from the recording in %s: %r -> %r", key, was, now)
    t0 = time.time()
    last = {}

    def eval_now(version: int) -> dict:
        return evaluate(flat_params(multihost.host_params(state.params)), version)
    if evaluate is not None:
        last = eval_now(0)
        files.metrics(0, {"version": 0, "wall_time_s": time.time() - t0, **last})

    # ------------------------------------------------------------------ loop
    step = 0
    for entry in index:
        arrays = recording.load_arrays(directory, entry)
        shape = arrays["input_ids"].shape
        if shape[0] != chunks:
            raise ConfigError("learner.minibatches", f"step {entry['step']} was recorded in "
                              f"{shape[0]} chunks; learner.minibatches x micro_batches = "
                              f"{chunks} (they must match the recording)")
        if shape[1] % divisor:
            raise ConfigError("mesh.shape", f"{shape[1]} recorded rows do not split over the "
                                            f"mesh's batch axes ({divisor})")
        t_step = time.time()
        state, metrics = step_fn(state, ts.place_batch(arrays, mesh))
        metrics = flatten_metrics(jax.device_get(metrics), entry.get("engines", ()))
        step_s = time.time() - t_step
        step += 1
        data = {k: v for k, v in entry["metrics"].items() if k.startswith(DATA_KEYS)}
        record = {"version": step, "wall_time_s": time.time() - t0,
                  "learner/step_time_s": step_s, "learner/lr": float(schedule(step - 1)),
                  "learner/skipped_steps": int(metrics["skipped"]),
                  "replay/recorded_version": entry["version"], **data}
        record.update({f"loss/{k}": float(v) for k, v in metrics.items()})
        if evaluate is not None and (L.eval_every and step % L.eval_every == 0
                                     or step == len(index)):
            last = eval_now(step)
            record.update(last)
        files.metrics(step, record)

    files.close()
    summary.update(steps=step, wall_time_s=time.time() - t0, **last)
    multihost.primary_or(lambda: _write_summary(workdir, summary), None)
    return summary


def _write_summary(workdir: str, summary: dict) -> None:
    with open(os.path.join(workdir, "replay.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
