"""Supervised warm start on a task's demonstrations.

RL from a random tiny model never sees a reward, so the default experiment first teaches the
model the task's output format (and some of the skill) by next-token cross-entropy on the
task's demonstrations. That is exactly the `reinforce` loss with advantage 1 on every
completion token (−Σ m·logp / Σ m), so this reuses the learner's packing and sharded train
step rather than a second training path. The result is a standard HF checkpoint directory
(`save_pretrained`) that RL, the embedded engine and SGLang servers all load.

The learner trains on tokens: the demonstrations arrive as advantage-1 `Rollout`s (with a
loss mask where the sequence holds context the model must not learn to write, e.g. tool
replies). Encoding a task's or an environment's demonstrations is the warm start's job
(`launch.demonstrations`).
"""
from __future__ import annotations

import json
import os
import time
from typing import Iterator

import jax
from flax import nnx

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.metrics import MetricsWriter
from pipelinerl_jax.models.factory import build_model
from pipelinerl_jax.models.hf_io import save_pretrained
from pipelinerl_jax.losses import get_loss
from pipelinerl_jax.run_config import completion_tokens
from pipelinerl_jax.records import Rollout


def run_sft(cfg, workdir: str, demos: Iterator[Rollout], tok, progress: bool = True,
            evaluate=None) -> dict:
    """Trains `cfg.warm_start.steps` steps on `demos` (an endless stream of advantage-1
    rollouts, `cfg.warm_start.batch_size` a step) and saves `workdir/model`. `tok` gives the
    vocabulary size and the pad id. Returns a summary dict.

    `evaluate(model, step) -> dict` (optional; e.g. held-out greedy accuracy,
    `launch.roles.evaluated_sft` passes one) is called at the end, and with `warm_start.target_accuracy`
    set also every `warm_start.eval_every` steps: training stops at the first evaluation
    whose `eval/accuracy` reaches the target (`steps` is then the most it trains). Held-out
    accuracy climbs a cliff during SFT whose position moves with the seed and with last-bit
    differences, so a fixed step count lands anywhere on it (docs/experiments.md, "The warm
    start"); stopping at a target lands where RL starts on purpose. The summary records
    `stopped_at` and `target_reached`; `sft_metrics.jsonl` every evaluation.
    """
    mesh = sharding_lib.make_mesh(tuple(cfg.mesh.shape))
    model = build_model(cfg.model, tok.vocab_size, mesh, seed=cfg.seed)
    graphdef = nnx.graphdef(model)
    s = cfg.warm_start
    optimizer, schedule = ts.make_optimizer(s.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    step_fn = ts.make_train_step(graphdef, optimizer, get_loss("reinforce", diagnostics=False), mesh=mesh,
                                 state_sharding=ts.state_shardings(state),
                                 micro_batches=s.micro_batches)
    pack_kw = dict(num_seqs=s.batch_size, chunks=s.micro_batches, pack_len=cfg.model.max_seq_len,
                   completion_len=completion_tokens(cfg),
                   row_divisor=sharding_lib.batch_divisor(mesh), pad_id=tok.pad_id)
    writer = MetricsWriter(workdir, "sft_metrics.jsonl")
    bar = None
    if progress:
        from tqdm import tqdm  # progress only
        bar = tqdm(total=s.steps, desc="warm start (SFT)", unit="step", dynamic_ncols=True)
    target = s.get("target_accuracy") or 0.0
    gated = target > 0 and evaluate is not None
    t0 = time.time()
    loss, trained, reached = float("nan"), 0, None
    for step in range(s.steps):
        rows = [next(demos) for _ in range(s.batch_size)]
        batch = batching.pack(rows, 0, **pack_kw)
        state, metrics = step_fn(state, batch.arrays)
        trained = step + 1
        if step % s.log_every == 0 or step == s.steps - 1:
            loss = float(metrics["loss"])
            writer.write(step, {"sft/loss": loss, "sft/lr": float(schedule(step)),
                                "wall_time_s": time.time() - t0})
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}")
        if bar is not None:
            bar.update(1)
        if gated and trained % s.eval_every == 0 and trained < s.steps:
            nnx.update(model, jax.device_get(state.params))
            result = evaluate(model, trained)
            writer.write(step, {"sft/eval_accuracy": result["eval/accuracy"],
                                "wall_time_s": time.time() - t0})
            if result["eval/accuracy"] >= target:
                reached = result  # (the model evaluated here is the one saved)
                break
    if bar is not None:
        bar.close()
    nnx.update(model, jax.device_get(state.params))
    out_dir = os.path.join(workdir, "model")
    save_pretrained(model, out_dir)
    summary = {"steps": s.steps, "stopped_at": trained, "final_loss": loss,
               "time_s": time.time() - t0, "checkpoint": out_dir}
    if evaluate is not None:
        result = reached if reached is not None else evaluate(model, trained)
        summary.update(result)
        if target > 0:
            summary["target_accuracy"] = target
            summary["target_reached"] = bool(result["eval/accuracy"] >= target)
    writer.close()
    with open(os.path.join(workdir, "sft_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
