"""The learner process: RolloutQueue batches → sharded train step → new weights out.

Read top to bottom (big_vision style): mesh, model and step, checkpoint restore, transport,
the loop, the end. One learner step:

    batch = queue.get_batch(B groups)            # whole groups, staleness policy applied
    pack → [B·G, T] bucketed arrays              # lag measured now, at train time
    state, metrics = train_step(state, batch)    # jitted, sharded, donated
    version += 1; publish(version, params)       # background: announce, then ship
    every `checkpoint_every` steps: save (async); ack the batches the previous save covers

The learner is handed its parts and knows no engine: batches come from the `batches` source
it is handed (the queue client on process 0, a stand-in elsewhere or in a test), weights leave
through the `weight_sink` it is handed (`transport.weight_sink`: a stream of arrays or HF
directories, the launcher chooses), the versions held-out evaluation measures go to the
`evals` outbox it is handed (`transport.eval_versions.EvalOutbox`; the evaluator role evaluates
them in its own process, off the step), and under lag injection `lag_injection.LagInjector`
says which version's params to ship. The loss says what it needs (its resolved aggregation,
whether it uses the proximal policy). The state the loop changes is explicit: `Progress` (steps, version,
trained batch ids: what a checkpoint commits) and the lag controller, whose limit travels to the
publication thread with each version (`Shipper`) instead of being read from there. Each step's
`metrics.jsonl` row is built by `step_record`.

At-least-once delivery + the trained-batch ids stored in each checkpoint make a crash safe:
unacknowledged batches are redelivered to the restarted learner, which retrains those after
its checkpoint and skips (and acks) any whose step was already committed. Every delivered
batch is a line of `workdir/batches.jsonl` (what was trained, or skipped, and its groups),
the audit trail of what the model saw. A queue that is unreachable (restarting) is waited
for: `get_batch` is retried, and the version is announced again with every call, so a
restarted, empty queue learns it at once.

A learner may be P processes on one global mesh (`multihost.py`): every process runs this same
function on the same batch (process 0 pulls it, the others receive it); only process 0 talks
to the queue, publishes weights and writes files, the others hold stand-ins that do nothing
(`learner_batches` builds the right source for each).

Publication overlaps the next step (`publication.py`): right after a step the params are
snapshotted (an on-device copy the donated step cannot invalidate) and one background thread
fetches them, announces the version to the queue and ships it, in version order, one at a
time; the step after waits only if that publication is not finished by then. The same thread
hands the versions due for evaluation (step 0, every `learner.eval_every` steps, the last) to
the evaluator, the learner's own params even under lag injection; nothing waits for their
evaluation. Under lag injection a checkpoint waits for the publication; the run ends after
the last one.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence

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
from pipelinerl_jax.models import flat_params, from_pretrained
from pipelinerl_jax.models.lora import attach_lora, base_identity, lora_spec
from pipelinerl_jax.run_config import completion_tokens, publish_dtype
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport.queue_client import Batch, QueueUnavailable

log = logging.getLogger(__name__)


class TooManySkippedSteps(RuntimeError):
    pass


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


def learner_batches(cfg) -> "BatchSource":
    """The batch source of this learner process: a client of the run's queue on process 0,
    `multihost.NullQueue` on the others. The caller closes it."""
    from pipelinerl_jax.transport import RolloutQueueClient, client_kwargs, queue_address
    return multihost.primary_or(
        lambda: RolloutQueueClient(queue_address(cfg.transport), **client_kwargs(cfg.transport)),
        multihost.NullQueue())


class BatchSource(Protocol):
    """Where the learner's batches come from and whom it tells what it trained: a
    `transport.RolloutQueueClient` (process 0), `multihost.NullQueue` (the other processes of
    a multi-process learner), or a test's stand-in. The caller builds and closes it."""

    def wait_ready(self, deadline_s: float) -> None: ...

    def get_batch(self, num_groups: int, timeout_s: float, learner_version: Optional[int] = None,
                  **announce) -> Optional[Batch]: ...

    def set_version(self, version: int, **announce) -> int: ...

    def ack(self, batch_ids: Sequence[str]) -> int: ...


class Shipper:
    """The publication thread's job for one version (`Publication` runs it): announce the
    version to the queue, then deliver it through the weight sink (in this order: rollouts
    sampled with it may reach the queue the moment an engine has it). Returns its flat params.

    What it shares with the learner's main thread is explicit: the lag limit to announce
    arrives with each version (taken when the version was trained, so the main thread's
    controller may move on meanwhile), and the lag injector's history is written only here;
    the main thread reads it only after `Publication.result()`, which orders that read after
    the last ship.

    `evals`: an `EvalOutbox` (or None) that receives the learner's own params of each version,
    after its delivery; it writes the versions due for evaluation."""

    def __init__(self, queue: BatchSource, sink, injector: Optional[LagInjector] = None,
                 evals=None):
        self.queue, self.sink, self.injector, self.evals = queue, sink, injector, evals

    def __call__(self, version: int, host, announce: Mapping) -> Dict[str, np.ndarray]:
        flat = flat_params(host)
        try:
            self.queue.set_version(version, **announce)
        except QueueUnavailable as e:  # restarting: the next get_batch announces it
            log.warning("could not announce version %d to the queue: %s", version, e)
        if self.injector is None:
            self.sink.publish(version, flat)
        else:  # version - k's params, with their policy version in the header
            policy_version, params = self.injector.ship(version, host)
            self.sink.publish(version, flat_params(params), policy_version)
        if self.evals is not None:
            self.evals.put(version, flat)
        return flat


@dataclasses.dataclass
class Progress:
    """What the learner has done, as every checkpoint commits it: steps, the policy version,
    the ids of the batches trained (so a restarted learner never trains one twice)."""
    step: int = 0
    version: int = 0
    trained: List[str] = dataclasses.field(default_factory=list)
    wall_offset_s: float = 0.0  # wall time of the run before this process resumed it
    lora_base: Optional[dict] = None  # LoRA: the base the adapters belong to (base_identity)

    def __post_init__(self):
        self.trained_set = set(self.trained)

    def trained_one(self, batch_id: str) -> None:
        self.step += 1
        self.version += 1
        self.trained.append(batch_id)
        self.trained_set.add(batch_id)

    def meta(self, wall_time_s: float) -> dict:
        meta = {"version": self.version, "trained_batch_ids": self.trained[-10000:],
                "wall_time_s": wall_time_s}
        if self.lora_base is not None:
            meta["lora_base"] = self.lora_base
        return meta


def save_checkpoint(acks: BatchAcks, progress: Progress, state, wall_time_s: float,
                    publication: Publication, injector: Optional[LagInjector]) -> None:
    """Checkpoints `state` at `progress` (async; acks what the previous save covered). Under
    lag injection the injector's history is saved too, once the version just published is in
    it."""
    if injector is not None:
        publication.result()
    acks.checkpoint(progress.step, ts.checkpointed(state), progress.meta(wall_time_s),
                    history=None if injector is None else injector.history)


def step_record(*, version: int, wall_time_s: float, step_s: float, wait_s: float, sync_s: float,
                packed, lr: float, skipped: int, publication: Publication, batch, feed,
                rollouts, metrics: Mapping, control: Mapping) -> dict:
    """One step's `metrics.jsonl` row (docs/metrics.md): the learner's timings, the batch's
    rewards, lengths and lags (measured at the version it was trained at, `version - 1`),
    the loss diagnostics and the lag controller's decision."""
    record = {"version": version, "wall_time_s": wall_time_s,
              "learner/step_time_s": step_s, "learner/wait_time_s": wait_s,
              "learner/tokens": packed.num_tokens, "learner/pack_fill": packed.fill,
              "learner/tokens_per_s": packed.num_tokens / max(step_s, 1e-9),
              "learner/lr": lr, "learner/skipped_steps": skipped,
              "weight_sync/time_s": sync_s,
              "weight_sync/background_s": publication.last_duration_s,
              "queue/redelivered": int(batch.redelivered),
              "queue/unavailable_errors": feed.unavailable}
    record.update(batch_metrics(rollouts, packed, version - 1))
    record.update({f"loss/{k}": float(v) for k, v in metrics.items()})
    record.update(control)
    return record


def run_learner(cfg, workdir: str, init_checkpoint: str, stop_event=None, *,
                batches: BatchSource, weight_sink, evals=None,
                clock: Callable[[], float] = time.time) -> dict:
    """Trains `learner.total_steps` steps from `init_checkpoint` (or the workdir's latest
    checkpoint); returns the final step and version.

    `batches`: the `BatchSource` batches come from and versions and acks go to.
    `weight_sink`: a `transport.weight_sink.WeightSink` every version goes out through.
    The caller builds and closes both. `evals`: a `transport.eval_versions.EvalOutbox`, or None
    (no held-out evaluation, or not this process's job): the versions due for evaluation
    (step 0, every `learner.eval_every` steps, the last) go there; the evaluator role writes
    their `eval/*` records (`eval.jsonl`, merged by `metrics.read_metrics`).
    `clock`: seconds, for the durations and wall time the metrics report.
    """
    L = cfg.learner
    tok = get_tokenizer(cfg.tokenizer)

    # ------------------------------------------------------------------ mesh, model, step
    multihost.check_mesh(cfg.mesh.shape)
    mesh = sharding_lib.make_mesh(tuple(cfg.mesh.shape))
    model = from_pretrained(init_checkpoint, dtype=cfg.model.dtype,
                            param_dtype=cfg.model.param_dtype, mesh=mesh)
    if lora_spec(cfg) is not None:  # only the adapters train and are published (docs/lora.md)
        attach_lora(model, lora_spec(cfg), mesh, seed=cfg.seed)
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
    base_id = base_identity(init_checkpoint) if lora_spec(cfg) is not None else None
    progress, history = Progress(lora_base=base_id), {}
    if ckpt.latest_step() is not None:
        saved, meta, step, history = ckpt.restore(ts.checkpointed(state),
                                                  history_like=state.params)
        if base_id is not None and (meta.get("lora_base") or {}).get("sha256") != \
                base_id["sha256"]:
            raise ValueError(f"checkpoint step {step} in {ckpt.directory} holds LoRA adapters "
                             f"of the base {meta.get('lora_base')}, not of this run's init "
                             f"checkpoint {base_id}")
        state = ts.restored(state, saved)
        progress = Progress(step, meta["version"], list(meta["trained_batch_ids"]),
                            meta.get("wall_time_s", 0.0), lora_base=base_id)
        log.info("resumed from step %d (version %d)", step, progress.version)
    injector = LagInjector(cfg.lag_injection, history) if cfg.lag_injection.enabled else None

    # ------------------------------------------------------------------ transport, outputs
    # Process 0 writes the run's files; the others hold a stand-in (as for `batches`).
    files = multihost.primary_or(lambda: multihost.RunFiles(workdir), multihost.Silent())
    batches.wait_ready(60.0)
    feed = multihost.BatchFeed(batches)
    acks = BatchAcks(batches, ckpt)
    lag_ctl = LagController.from_config(cfg)  # the allowed lag: fixed, or closed-loop
    recorder = recording.recorder(cfg, workdir, init_checkpoint)  # learner.record_batches
    publication = Publication(Shipper(batches, weight_sink, injector, evals),
                              dtype=publish_dtype(cfg))
    publication.submit(progress.version, state.params, lag_ctl.announce())
    publication.result()
    t0 = clock() - progress.wall_offset_s

    consecutive_skips = 0
    if evals is not None and progress.step == 0:  # the row version 0's evaluation joins
        files.metrics(0, {"version": progress.version, "wall_time_s": clock() - t0})

    # ------------------------------------------------------------------ loop
    # The wait for a batch runs from the end of the previous step's work to the arrival of the
    # batch trained next: empty polls, queue outages and redelivered committed batches count.
    t_wait = clock()
    try:
        while progress.step < L.total_steps:
            step, version = progress.step, progress.version
            batch, stop = feed.next(L.batch_groups, L.get_timeout_s, version,
                                    stop=stop_event is not None and stop_event.is_set(),
                                    **lag_ctl.announce())
            if stop:
                break
            if batch is None:
                continue
            wait_s = clock() - t_wait
            rollouts = sorted(batch.rollouts, key=lambda r: _group_key(r.group_id))
            if batch.batch_id in progress.trained_set:  # committed before a crash: never twice
                files.batch(batch_record(batch, rollouts, "skipped_committed", step, version))
                acks.ack([batch.batch_id])
                continue
            packed = batching.pack(rollouts, version, **pack_kw)
            t_step = clock()
            state, metrics = step_fn(state, ts.place_batch(packed.arrays, mesh))
            metrics = flatten_metrics(jax.device_get(metrics), packed.engines)
            step_s = clock() - t_step
            control = lag_ctl.update(metrics, packed.arrays, wait_s, step_s)  # announced next
            skipped = int(metrics["skipped"])
            consecutive_skips = consecutive_skips + 1 if skipped else 0

            files.batch(dict(batch_record(batch, rollouts, "trained", step + 1, version),
                             update_skipped=bool(skipped)))
            progress.trained_one(batch.batch_id)
            step, version = progress.step, progress.version
            acks.unacked.append(batch.batch_id)
            t_sync = clock()
            publication.submit(version, state.params, lag_ctl.announce())
            sync_s = clock() - t_sync

            record = step_record(
                version=version, wall_time_s=clock() - t0, step_s=step_s, wait_s=wait_s,
                sync_s=sync_s, packed=packed, lr=float(schedule(step - 1)), skipped=skipped,
                publication=publication, batch=batch, feed=feed, rollouts=rollouts,
                metrics=metrics, control=control)
            if recorder is not None:  # the exact arrays just trained on, for replay
                recorder.record(step, version - 1, batch.batch_id, rollouts, packed.arrays, record,
                                packed.engines)
            files.metrics(step, record)
            if step % L.checkpoint_every == 0 or step == L.total_steps:
                save_checkpoint(acks, progress, state, clock() - t0, publication, injector)
            else:  # the previous save is durable: let the queue forget its batches
                acks.ack_durable()
            if consecutive_skips >= L.max_consecutive_skips:
                save_checkpoint(acks, progress, state, clock() - t0, publication, injector)
                ckpt.wait()
                raise TooManySkippedSteps(
                    f"{consecutive_skips} consecutive steps had a non-finite loss or gradient "
                    f"(learner.max_consecutive_skips={L.max_consecutive_skips}); stopped at step "
                    f"{step} with a checkpoint of the last good state in {ckpt.directory}")
            t_wait = clock()
    except BaseException:  # the thread must not ship into a sink the caller closes
        publication.abandon()
        raise

    # ------------------------------------------------------------------ end
    publication.close()  # the last version is out before the run reports done
    if evals is not None:  # the last version is evaluated even when not due (stopped early)
        evals.finish(progress.version, publication.result())
    if acks.unacked:
        save_checkpoint(acks, progress, state, clock() - t0, publication, injector)
    acks.finish()
    ckpt.close()
    files.close()
    files.done({"step": progress.step, "version": progress.version})
    return {"step": progress.step, "version": progress.version}
