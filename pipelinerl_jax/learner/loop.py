"""The learner process: RolloutQueue batches → sharded train step → new weights out.

Read top to bottom (big_vision style): mesh, model and step, checkpoint restore, transport,
the loop, the end. One learner step:

    batch = queue.get_batch(B groups)            # whole groups, staleness policy applied
    pack → [B·G, T] bucketed arrays              # lag measured now, at train time
    state, metrics = train_step(state, batch)    # jitted, sharded, donated
    version += 1; publish(version, params)       # background: announce, then ship
    every `checkpoint_every` steps: save (async); ack the batches the previous save covers

The learner knows no engine: weights leave through the `weight_sink` it is handed
(`transport.weight_sink`: a stream of arrays or HF directories, the launcher chooses),
held-out evaluation is the `evaluate(params_flat, version)` callable it is handed, and under
lag injection `lag_injection.LagInjector` says which version's params to ship. The loss says
what it needs (its resolved aggregation, whether it uses the proximal policy).

At-least-once delivery + the trained-batch ids stored in each checkpoint make a crash safe:
unacknowledged batches are redelivered to the restarted learner, which retrains those after
its checkpoint and skips (and acks) any whose step was already committed. Every delivered
batch is a line of `workdir/batches.jsonl` (what was trained, or skipped, and its groups),
the audit trail of what the model saw. A queue that is unreachable (restarting) is waited
for: `get_batch` is retried, and the version is announced again with every call, so a
restarted, empty queue learns it at once.

A learner may be P processes on one global mesh (`multihost.py`): every process runs this same
function on the same batch (process 0 pulls it, the others receive it); only process 0 talks
to the queue, publishes weights and writes files, the others hold stand-ins that do nothing.

Publication overlaps the next step (`publication.py`): right after a step the params are
snapshotted (an on-device copy the donated step cannot invalidate) and one background thread
fetches them, announces the version to the queue and ships it, in version order, one at a
time; the step after waits only if that publication is not finished by then. Evaluation and
(under lag injection) a checkpoint wait for it; the run ends after the last one.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Callable, Dict, List, Optional

import jax
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.lag_control import LagController
from pipelinerl_jax.lag_injection import LagInjector
from pipelinerl_jax.learner import batching, multihost, recording, train_step as ts
from pipelinerl_jax.learner.publication import Publication
from pipelinerl_jax.learner.checkpoint import Checkpointer
from pipelinerl_jax.losses import flatten_metrics, loss_from_config
from pipelinerl_jax.models import from_pretrained
from pipelinerl_jax.run_config import completion_tokens
from pipelinerl_jax.tokenizers import get_tokenizer
from pipelinerl_jax.transport import RolloutQueueClient, client_kwargs, queue_address
from pipelinerl_jax.transport.queue_client import QueueUnavailable

log = logging.getLogger(__name__)


class TooManySkippedSteps(RuntimeError):
    pass


def flat_params(host) -> Dict[str, np.ndarray]:
    """`{"layers/0/attn/q_proj": ndarray}` of a pure-dict tree of host arrays (the
    weight-sync payload)."""
    leaves = jax.tree_util.tree_flatten_with_path(host)[0]
    return {sharding_lib.path_name(p): np.asarray(v) for p, v in leaves}


def uses_proximal(setting, loss_fn) -> bool:
    """`learner.recompute_proximal`: 'auto' means whatever the loss declares it needs."""
    return bool(loss_fn.needs_proximal) if setting == "auto" else bool(setting)


def make_step(cfg, model, optimizer, mesh, state):
    """The jitted train step of `cfg`. The loss's own resolved hyperparameters decide the
    micro-batch weighting (by tokens for `token_mean`, the default aggregation), never the
    raw config section, whose unset keys are None placeholders."""
    L, loss_fn = cfg.learner, loss_from_config(cfg.loss)
    return ts.make_train_step(
        nnx.graphdef(model), optimizer, loss_fn, mesh=mesh,
        state_sharding=ts.state_shardings(state), temperature=cfg.sampling.temperature or 1.0,
        minibatches=L.minibatches, micro_batches=L.micro_batches,
        use_proximal=uses_proximal(L.recompute_proximal, loss_fn),
        token_weighted=loss_fn.hparams.get("agg") == "token_mean")


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
    out.update(batching.episode_metrics(rollouts, version))  # multi-turn episodes
    return out


class BatchAcks:
    """Acknowledges trained batches to the queue once a durable checkpoint covers them; until
    then the queue keeps them and redelivers them to a restarted learner."""

    def __init__(self, client, ckpt: Checkpointer):
        self.client, self.ckpt = client, ckpt
        self.unacked: List[str] = []  # trained, not yet covered by a durable checkpoint
        self.covered: List[str] = []  # covered by the checkpoint being saved
        self.failed: List[str] = []  # committed, but the ack did not reach the queue yet

    def ack(self, batch_ids) -> None:
        todo = self.failed + list(batch_ids)
        if not todo:
            return
        try:
            self.client.ack(todo)
            self.failed = []
        except QueueUnavailable as e:  # retried with the next checkpoint's acks
            log.warning("ack of %d batches failed: %s", len(todo), e)
            self.failed = todo

    def checkpoint(self, step: int, state, meta: dict, history) -> None:
        """Saves (async) once the previous save is durable, acking the batches it covered."""
        self.ckpt.wait()
        self.ack(self.covered)
        self.ckpt.save(step, state, meta, history=history)
        self.covered, self.unacked = self.unacked, []

    def ack_durable(self) -> None:
        """Acks the batches of a save that has finished, without waiting for one."""
        if self.covered and not self.ckpt.saving():
            self.ckpt.wait()
            self.ack(self.covered)
            self.covered = []

    def finish(self) -> None:
        self.ckpt.wait()
        self.ack(self.covered)
        self.covered = []


def run_learner(cfg, workdir: str, init_checkpoint: str, stop_event=None, *,
                weight_sink, evaluate: Optional[Callable[[dict, int], dict]] = None) -> dict:
    """Trains `learner.total_steps` steps from `init_checkpoint` (or the workdir's latest
    checkpoint); returns the final step, version and last evaluation.

    `weight_sink`: a `transport.weight_sink.WeightSink` every version goes out through (the
    caller closes it). `evaluate(params_flat, version) -> metrics`, or None: held-out
    evaluation every `learner.eval_every` steps, at step 0 and at the end.
    """
    L = cfg.learner
    tok = get_tokenizer(cfg.tokenizer)

    # ------------------------------------------------------------------ mesh, model, step
    multihost.check_mesh(cfg.mesh.shape)
    mesh = sharding_lib.make_mesh(tuple(cfg.mesh.shape))
    model = from_pretrained(init_checkpoint, dtype=cfg.model.dtype,
                            param_dtype=cfg.model.param_dtype, mesh=mesh)
    optimizer, schedule = ts.make_optimizer(L.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    step_fn = make_step(cfg, model, optimizer, mesh, state)
    pack_kw = dict(num_seqs=L.batch_groups * cfg.rollout.group_size,
                   chunks=L.minibatches * L.micro_batches, pack_len=cfg.model.max_seq_len,
                   completion_len=completion_tokens(cfg),
                   row_divisor=sharding_lib.batch_divisor(mesh), pad_id=tok.pad_id)

    # ------------------------------------------------------------------ checkpoint restore
    multihost.barrier("model-built")  # orbax's first collective: every process is ready
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=L.keep_checkpoints)
    step, version, trained, t_offset, history = 0, 0, [], 0.0, {}
    if ckpt.latest_step() is not None:
        state, meta, step, history = ckpt.restore(state, history_like=state.params)
        version, trained = meta["version"], list(meta["trained_batch_ids"])
        t_offset = meta.get("wall_time_s", 0.0)
        log.info("resumed from step %d (version %d)", step, version)
    trained_set = set(trained)
    injector = LagInjector(cfg.lag_injection, history) if cfg.lag_injection.enabled else None

    # ------------------------------------------------------------------ transport, outputs
    # Process 0 talks to the queue and writes the run's files; the others hold stand-ins.
    queue, files = multihost.primary_or(
        lambda: (RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport)),
                 multihost.RunFiles(workdir)),
        (multihost.NullQueue(), multihost.Silent()))
    queue.wait_ready(60.0)
    feed = multihost.BatchFeed(queue)
    acks = BatchAcks(queue, ckpt)
    lag_ctl = LagController.from_config(cfg)  # the allowed lag: fixed, or closed-loop
    recorder = recording.recorder(cfg, workdir, init_checkpoint)  # learner.record_batches

    def ship(version: int, host) -> Dict[str, np.ndarray]:
        """Announce `version` to the queue, then ship it (this order: rollouts sampled with
        it may reach the queue the moment an engine has it). Returns the current params.
        Runs on the publication thread."""
        flat = flat_params(host)
        try:
            queue.set_version(version, **lag_ctl.announce())
        except QueueUnavailable as e:  # restarting: the next get_batch announces it
            log.warning("could not announce version %d to the queue: %s", version, e)
        if injector is None:
            weight_sink.publish(version, flat)
        else:  # version - k's params, with their policy version in the header
            policy_version, params = injector.ship(version, host)
            weight_sink.publish(version, flat_params(params), policy_version)
        return flat

    publication = Publication(ship)
    publication.submit(version, state.params)
    params_flat = publication.result()
    t0 = time.time() - t_offset

    def checkpoint() -> None:
        if injector is not None:  # its history must hold the version just published
            publication.result()
        acks.checkpoint(step, state, {"version": version, "trained_batch_ids": trained[-10000:],
                                      "wall_time_s": time.time() - t0},
                        history=None if injector is None else injector.history)

    consecutive_skips, last = 0, {}
    if evaluate is not None and step == 0:
        last = evaluate(params_flat, version)
        files.metrics(0, {"version": version, "wall_time_s": time.time() - t0, **last})

    # ------------------------------------------------------------------ loop
    # The wait for a batch runs from the end of the previous step's work to the arrival of the
    # batch trained next: empty polls, queue outages and redelivered committed batches count.
    t_wait = time.time()
    try:
        while step < L.total_steps:
            batch, stop = feed.next(L.batch_groups, L.get_timeout_s, version,
                                    stop=stop_event is not None and stop_event.is_set(),
                                    **lag_ctl.announce())
            if stop:
                break
            if batch is None:
                continue
            wait_s = time.time() - t_wait
            rollouts = sorted(batch.rollouts, key=lambda r: _group_key(r.group_id))
            if batch.batch_id in trained_set:  # committed before a crash: never train twice
                files.batch(batch_record(batch, rollouts, "skipped_committed", step, version))
                acks.ack([batch.batch_id])
                continue
            packed = batching.pack(rollouts, version, **pack_kw)
            t_step = time.time()
            state, metrics = step_fn(state, ts.place_batch(packed.arrays, mesh))
            metrics = flatten_metrics(jax.device_get(metrics))
            step_s = time.time() - t_step
            control = lag_ctl.update(metrics, packed.arrays, wait_s, step_s)  # announced next
            skipped = int(metrics["skipped"])
            consecutive_skips = consecutive_skips + 1 if skipped else 0

            files.batch(dict(batch_record(batch, rollouts, "trained", step + 1, version),
                             update_skipped=bool(skipped)))
            step += 1
            version += 1
            trained.append(batch.batch_id)
            trained_set.add(batch.batch_id)
            acks.unacked.append(batch.batch_id)
            t_sync = time.time()
            publication.submit(version, state.params)
            sync_s = time.time() - t_sync

            record = {"version": version, "wall_time_s": time.time() - t0,
                      "learner/step_time_s": step_s, "learner/wait_time_s": wait_s,
                      "learner/tokens": packed.num_tokens, "learner/pack_fill": packed.fill,
                      "learner/tokens_per_s": packed.num_tokens / max(step_s, 1e-9),
                      "learner/lr": float(schedule(step - 1)), "learner/skipped_steps": skipped,
                      "weight_sync/time_s": sync_s,
                      "weight_sync/background_s": publication.last_duration_s,
                      "queue/redelivered": int(batch.redelivered),
                      "queue/unavailable_errors": feed.unavailable}
            record.update(batch_metrics(rollouts, packed, version - 1))
            record.update({f"loss/{k}": float(v) for k, v in metrics.items()})
            record.update(control)
            if recorder is not None:  # the exact arrays just trained on, for replay
                recorder.record(step, version - 1, batch.batch_id, rollouts, packed.arrays, record)
            if evaluate is not None and (step % L.eval_every == 0 or step == L.total_steps):
                last = evaluate(publication.result(), version)
                record.update(last)
            files.metrics(step, record)
            if step % L.checkpoint_every == 0 or step == L.total_steps:
                checkpoint()
            else:  # the previous save is durable: let the queue forget its batches
                acks.ack_durable()
            if consecutive_skips >= L.max_consecutive_skips:
                checkpoint()
                ckpt.wait()
                raise TooManySkippedSteps(
                    f"{consecutive_skips} consecutive steps had a non-finite loss or gradient "
                    f"(learner.max_consecutive_skips={L.max_consecutive_skips}); stopped at step "
                    f"{step} with a checkpoint of the last good state in {ckpt.directory}")
            t_wait = time.time()
    except BaseException:  # the thread must not ship into a sink the caller closes
        publication.abandon()
        raise

    # ------------------------------------------------------------------ end
    publication.close()  # the last version is out before the run reports done
    if acks.unacked:
        checkpoint()
    acks.finish()
    ckpt.close()
    files.close()
    files.done({"step": step, "version": version})
    queue.close()
    return {"step": step, "version": version, **last}
