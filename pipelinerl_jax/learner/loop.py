"""The learner process: RolloutQueue batches → sharded train step → new weights out.

Read top to bottom (big_vision style): mesh, model and optimizer, checkpoint restore,
transport, the loop, the end. One learner step:

    batch = queue.get_batch(B groups)            # whole groups, staleness policy applied
    pack → [B·G, T] bucketed arrays              # lag measured now, at train time
    state, metrics = train_step(state, batch)    # jitted, sharded, donated
    version += 1; queue.set_version(version); publisher.publish(version, params)
    every `checkpoint_every` steps: save (async); ack the batches the previous save covers

At-least-once delivery + the trained-batch ids stored in each checkpoint make a crash safe:
unacknowledged batches are redelivered to the restarted learner, which retrains those after
its checkpoint and skips (and acks) any whose step was already committed. Every delivered
batch is a line of `workdir/batches.jsonl` (what was trained, or skipped, and its groups),
the audit trail of what the model saw. A queue that is unreachable (restarting) is waited
for: `get_batch` is retried, and the version is announced again with every call, so a
restarted, empty queue learns it at once.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Dict, List

import jax
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.learner.checkpoint import Checkpointer
from pipelinerl_jax.metrics import MetricsWriter, append_jsonl
from pipelinerl_jax.rollout.worker import injected_lag

log = logging.getLogger(__name__)

# Losses whose `logp_old` is the proximal policy when one is given (DESIGN.md).
PROXIMAL_LOSSES = ("decoupled_ppo", "icepop", "staleness_clip")


class TooManySkippedSteps(RuntimeError):
    pass


def flat_host_params(params) -> Dict[str, np.ndarray]:
    """`{"layers/0/attn/q_proj": ndarray}` of a pure-dict param tree (the weight-sync payload)."""
    host = jax.device_get(params)
    leaves = jax.tree_util.tree_flatten_with_path(host)[0]
    return {sharding_lib.path_name(p): np.asarray(v) for p, v in leaves}


def uses_proximal(cfg) -> bool:
    setting = cfg.learner.recompute_proximal
    if setting == "auto":
        return cfg.loss.name in PROXIMAL_LOSSES
    return bool(setting)


def _group_key(group_id: str):
    """Sort key making batch row order independent of arrival order (determinism)."""
    head, _, tail = group_id.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (group_id, 0)


def batch_record(batch, rollouts, action: str, step: int, version: int) -> dict:
    """One line of `batches.jsonl`: a delivered batch, what the learner did with it
    ('trained' at `version` into `step`, or 'skipped_committed'), and its groups (whole
    groups only: `incomplete_groups` lists any with fewer members than their group_size)."""
    members = collections.Counter(r.group_id for r in rollouts)
    declared = {r.group_id: r.group_size for r in rollouts}
    return {"time_s": time.time(), "pid": os.getpid(), "batch_id": batch.batch_id,
            "action": action, "step": step, "version": version,
            "delivery_count": int(batch.delivery_count), "num_rollouts": len(rollouts),
            "num_groups": len(members), "group_ids": sorted(members),
            "incomplete_groups": sorted(g for g, n in members.items() if n != declared[g])}


def batch_metrics(rollouts, packed, version: int) -> dict:
    m = packed.arrays["loss_mask"] > 0
    lag = packed.arrays["lag"][m]
    kv_lag = packed.arrays["kv_lag"][m]
    lengths = [len(r.completion_ids) for r in rollouts]
    out = {
        "reward/mean": float(np.mean([r.reward for r in rollouts])),
        "accuracy": float(np.mean([r.metrics.get("correct", 0.0) for r in rollouts])),
        "rollout/response_length_mean": float(np.mean(lengths)),
        "rollout/response_length_max": int(np.max(lengths)),
        "rollout/response_lengths": lengths,
        "rollout/truncated_fraction": float(np.mean([r.finish_reason == "length"
                                                     for r in rollouts])),
        "lag/mean": float(lag.mean()) if lag.size else 0.0,
        "lag/max": int(lag.max()) if lag.size else 0,
        "lag/hist": np.bincount(lag, minlength=1).tolist() if lag.size else [],
        "kv_lag/mean": float(kv_lag.mean()) if kv_lag.size else 0.0,
        "start_lag/mean": float(np.mean([version - r.start_version for r in rollouts])),
        "sampler/occupancy": float(np.mean([r.metrics.get("engine_occupancy", 0.0)
                                            for r in rollouts])),
        "sampler/tokens_per_s": float(np.mean([r.metrics.get("engine_tokens_per_s", 0.0)
                                               for r in rollouts])),
    }
    return out


class Evaluator:
    """Held-out greedy accuracy with an embedded engine holding the learner's weights."""

    def __init__(self, cfg, model, task, tok):
        from pipelinerl_jax.rollout.jax_engine import JaxEngine
        self.task, self.tok = task, tok
        self.problems = task.eval_problems(cfg.learner.eval_size)
        engine_cfg = dict(cfg.engine)
        engine_cfg.update(max_slots=min(64, max(8, cfg.learner.eval_size)), kv_budget_tokens=0)
        self.engine = JaxEngine(model, engine_cfg, version=0, engine_id="eval")
        self.max_new_tokens = cfg.sampling.max_new_tokens

    def __call__(self, params_flat, version: int) -> dict:
        from pipelinerl_jax.types import GenerationRequest, SamplingParams
        if version != self.engine.version:
            self.engine.update_weights(params_flat, version)
        reqs = [GenerationRequest(f"eval-{version}-{i}",
                                  np.asarray(self.tok.encode_prompt(p.prompt), np.int32),
                                  SamplingParams(max_new_tokens=self.max_new_tokens,
                                                 temperature=0.0,
                                                 stop_token_ids=(self.tok.eos_id,)))
                for i, p in enumerate(self.problems)]
        t0 = time.time()
        outs = self.engine.generate(reqs)
        correct = [self.task.reward(p, self.tok.decode(c.token_ids, stop_at_eos=True),
                                    c.finish_reason).correct
                   for p, c in zip(self.problems, outs)]
        return {"eval/accuracy": float(np.mean(correct)),
                "eval/response_length_mean": float(np.mean([len(c.token_ids) for c in outs])),
                "eval/time_s": time.time() - t0}

    def close(self):
        self.engine.close()


def run_learner(cfg, workdir: str, init_checkpoint: str, stop_event=None) -> dict:
    from pipelinerl_jax.losses import flatten_metrics, loss_from_config
    from pipelinerl_jax.models import from_pretrained, save_pretrained
    from pipelinerl_jax.rollout.factory import weights_dir
    from pipelinerl_jax.transport.versioned_dir import gc_versions, write_versioned_dir
    from pipelinerl_jax.tasks import get_task
    from pipelinerl_jax.tokenizers import get_tokenizer
    from pipelinerl_jax.transport import (RolloutQueueClient, WeightPublisher, client_kwargs,
                                          publisher_kwargs, queue_address, weights_address)
    from pipelinerl_jax.transport.queue_client import QueueUnavailable

    L = cfg.learner
    tok, task = get_tokenizer(cfg.tokenizer), get_task(cfg.task)

    # ------------------------------------------------------------------ mesh, model, step
    mesh = sharding_lib.make_mesh(tuple(cfg.mesh.shape))
    model = from_pretrained(init_checkpoint, dtype=cfg.model.dtype,
                            param_dtype=cfg.model.param_dtype, mesh=mesh)
    graphdef = nnx.graphdef(model)
    optimizer, schedule = ts.make_optimizer(L.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    step_fn = ts.make_train_step(
        graphdef, optimizer, loss_from_config(cfg.loss), mesh=mesh,
        state_sharding=ts.state_shardings(state), temperature=cfg.sampling.temperature or 1.0,
        minibatches=L.minibatches, micro_batches=L.micro_batches,
        use_proximal=uses_proximal(cfg), token_weighted=cfg.loss.agg == "token_mean")
    pack_kw = dict(num_seqs=L.batch_groups * cfg.rollout.group_size,
                   chunks=L.minibatches * L.micro_batches, pack_len=cfg.engine.max_seq_len,
                   completion_len=cfg.sampling.max_new_tokens,
                   row_divisor=sharding_lib.batch_divisor(mesh), pad_id=tok.pad_id)

    # ------------------------------------------------------------------ checkpoint restore
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=L.keep_checkpoints)
    step, version, trained, t_offset, history = 0, 0, [], 0.0, {}
    if ckpt.latest_step() is not None:
        state, meta, step, history = ckpt.restore(state, history_like=state.params)
        version, trained = meta["version"], list(meta["trained_batch_ids"])
        t_offset = meta.get("wall_time_s", 0.0)
        log.info("resumed from step %d (version %d)", step, version)
    trained_set = set(trained)

    # ------------------------------------------------------------------ transport
    client = RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport))
    client.wait_ready(60.0)
    publisher = WeightPublisher(weights_address(cfg.transport), **publisher_kwargs(cfg.transport))

    inj = cfg.lag_injection
    history = dict(history)  # lag injection: recent versions' params (host pure dicts)

    def publish(version: int):
        """Announce `version` to the queue, then ship it (this order: rollouts sampled with
        it may reach the queue the moment an engine has it)."""
        flat = flat_host_params(state.params)
        try:
            client.set_version(version)
        except QueueUnavailable as e:  # restarting: the next get_batch announces it
            log.warning("could not announce version %d to the queue: %s", version, e)
        if inj.enabled:  # ship version - k's weights, tagged with their policy version
            history[version] = jax.device_get(state.params)
            for v in [v for v in history if v < version - inj.max_k]:
                del history[v]
            policy_version = version - injected_lag(inj, version)
            payload = {} if cfg.sampler.kind == "sglang" else flat_host_params(
                history[policy_version])
            payload["__policy_version__"] = np.asarray(policy_version, np.int64)
            publisher.publish(version, payload)
        elif cfg.sampler.kind == "sglang":  # HF directory on disk + a notification
            root = weights_dir(cfg, workdir)
            nnx.update(model, jax.device_get(state.params))
            write_versioned_dir(root, version, lambda d: save_pretrained(model, d),
                                overwrite=True)
            gc_versions(root, cfg.sampler.keep_weight_versions)
            publisher.publish(version, {})
        else:
            publisher.publish(version, flat)
        return flat

    params_flat = publish(version)

    evaluator = Evaluator(cfg, model, task, tok) if L.eval_every > 0 else None
    writer = MetricsWriter(workdir)
    t0 = time.time() - t_offset
    unacked: List[str] = []  # trained, not yet covered by a durable checkpoint
    covered: List[str] = []  # covered by the checkpoint being saved
    consecutive_skips, last = 0, {}
    queue_errors = 0
    batch_log = os.path.join(workdir, "batches.jsonl")
    unacked_ids: List[str] = []  # committed, but the ack did not reach the queue yet

    def ack(batch_ids):
        nonlocal unacked_ids
        todo = unacked_ids + list(batch_ids)
        if not todo:
            return
        try:
            client.ack(todo)
            unacked_ids = []
        except QueueUnavailable as e:  # retried with the next checkpoint's acks
            log.warning("ack of %d batches failed: %s", len(todo), e)
            unacked_ids = todo

    def checkpoint():
        nonlocal unacked, covered
        ckpt.wait()  # the previous save is durable: its batches may be forgotten
        ack(covered)
        ckpt.save(step, state, {"version": version, "trained_batch_ids": trained[-10000:],
                                "wall_time_s": time.time() - t0}, history=history)
        covered, unacked = unacked, []

    if evaluator is not None and step == 0:
        last = evaluator(params_flat, version)
        writer.write(0, {"version": version, "wall_time_s": time.time() - t0, **last})

    # ------------------------------------------------------------------ loop
    while step < L.total_steps and not (stop_event is not None and stop_event.is_set()):
        t_wait = time.time()
        try:
            batch = client.get_batch(L.batch_groups, timeout_s=L.get_timeout_s,
                                     learner_version=version)
        except QueueUnavailable as e:  # the queue is down or restarting: wait for it
            queue_errors += 1
            log.warning("queue unavailable (%s); retrying", e)
            continue
        if batch is None:
            continue
        wait_s = time.time() - t_wait
        rollouts = sorted(batch.rollouts, key=lambda r: _group_key(r.group_id))
        if batch.batch_id in trained_set:  # committed before a crash: never train twice
            append_jsonl(batch_log, [batch_record(batch, rollouts, "skipped_committed", step,
                                                  version)])
            ack([batch.batch_id])
            continue
        packed = batching.pack(rollouts, version, **pack_kw)
        t_step = time.time()
        state, metrics = step_fn(state, packed.arrays)
        metrics = flatten_metrics(jax.device_get(metrics))
        step_s = time.time() - t_step
        skipped = int(metrics["skipped"])
        consecutive_skips = consecutive_skips + 1 if skipped else 0

        append_jsonl(batch_log, [dict(batch_record(batch, rollouts, "trained", step + 1,
                                                   version), update_skipped=bool(skipped))])
        step += 1
        version += 1
        trained.append(batch.batch_id)
        trained_set.add(batch.batch_id)
        unacked.append(batch.batch_id)
        t_sync = time.time()
        params_flat = publish(version)
        sync_s = time.time() - t_sync

        record = {"version": version, "wall_time_s": time.time() - t0,
                  "learner/step_time_s": step_s, "learner/wait_time_s": wait_s,
                  "learner/tokens": packed.num_tokens, "learner/pack_fill": packed.fill,
                  "learner/tokens_per_s": packed.num_tokens / max(step_s, 1e-9),
                  "learner/lr": float(schedule(step - 1)), "learner/skipped_steps": skipped,
                  "weight_sync/time_s": sync_s, "queue/redelivered": int(batch.redelivered),
                  "queue/unavailable_errors": queue_errors}
        record.update(batch_metrics(rollouts, packed, version - 1))
        record.update({f"loss/{k}": float(v) for k, v in metrics.items()})
        if evaluator is not None and (step % L.eval_every == 0 or step == L.total_steps):
            last = evaluator(params_flat, version)
            record.update(last)
        writer.write(step, record)
        if step % L.checkpoint_every == 0 or step == L.total_steps:
            checkpoint()
        elif covered and not ckpt.saving():  # that save is durable: let the queue forget
            ckpt.wait()
            ack(covered)
            covered = []
        if consecutive_skips >= L.max_consecutive_skips:
            checkpoint()
            ckpt.wait()
            raise TooManySkippedSteps(
                f"{consecutive_skips} consecutive steps had a non-finite loss or gradient "
                f"(learner.max_consecutive_skips={L.max_consecutive_skips}); stopped at step "
                f"{step} with a checkpoint of the last good state in {ckpt.directory}")

    # ------------------------------------------------------------------ end
    if unacked:
        checkpoint()
    ckpt.wait()
    ack(covered)
    ckpt.close()
    writer.close()
    if evaluator is not None:
        evaluator.close()
    append_jsonl(os.path.join(workdir, "learner_done.jsonl"), [{"step": step, "version": version}])
    publisher.stop()
    client.close()
    return {"step": step, "version": version, **last}
