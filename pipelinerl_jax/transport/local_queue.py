"""The RolloutQueue in this process: `QueueCore` behind the client's interface, no gRPC.

    queue = LocalQueue.from_config(cfg.transport)
    worker = RolloutWorker(cfg, engine, task, tok, queue)        # a producer, as with a client
    run_learner(cfg, workdir, ckpt, batches=queue, ...)          # the learner's BatchSource

What goes through it is what goes through the server: a put is converted to `pb.Rollout`s,
checked by `codec.validate_rollout` against the transport limits and stored as serialized
bytes by the same `QueueCore`; a batch is cut into the same `GetBatchResponse` pieces and
decoded by `codec.rollout_from_pb`, so the learner receives the rollouts (float32 log-probs,
int32 versions) a gRPC client would. Only the sockets, the retries and the request framing
are gone. The single-process lag-injected runs (`launch/inprocess.py`) use it.
"""
from __future__ import annotations

import uuid
from typing import Optional, Sequence

from pipelinerl_jax import records
from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import rollout_from_pb, rollout_to_pb, validate_rollout
from pipelinerl_jax.transport.transport_section import limits_from_config
from pipelinerl_jax.transport.queue_client import Batch, PutResult, message_dict
from pipelinerl_jax.transport.queue_core import QueueCore


class LocalQueue:
    """A `QueueCore` with the methods of `RolloutQueueClient` the worker and learner call."""

    def __init__(self, core: QueueCore, limits, hold_s: float = 5.0):
        self.core, self.limits, self.hold_s = core, limits, hold_s
        self.producer_id = ""
        self.session_id = uuid.uuid4().hex

    @classmethod
    def from_config(cls, t) -> "LocalQueue":
        """From a validated `transport_config()` section, as `RolloutQueueServer.from_config`."""
        core = QueueCore(t.capacity_rollouts, t.capacity_bytes, t.max_lag, t.stale_policy,
                         t.incomplete_group_timeout_s, max_message_bytes=t.max_message_bytes)
        return cls(core, limits_from_config(t), hold_s=t.max_hold_s)

    # ---------------------------------------------------------------- producers

    def put(self, rollouts: Sequence[records.Rollout],
            timeout_s: Optional[float] = None) -> PutResult:
        msgs = [rollout_to_pb(r) for r in rollouts]
        announced = self.core.announced_version()
        infos = [validate_rollout(m, self.limits, announced) for m in msgs]
        accepted, dup = self.core.put([m.SerializeToString() for m in msgs], infos,
                                      uuid.uuid4().hex, self.hold_s, self.producer_id)
        return PutResult(accepted, dup)

    def put_group(self, rollouts: Sequence[records.Rollout],
                  timeout_s: Optional[float] = None) -> PutResult:
        if not rollouts or len(rollouts) != rollouts[0].group_size or \
                any(r.group_id != rollouts[0].group_id for r in rollouts):
            raise ValueError("put_group: exactly one whole group expected")
        return self.put(rollouts, timeout_s)

    def stats(self, timeout_s: float = 60.0) -> dict:
        return message_dict(self.core.stats(self.producer_id))

    # ---------------------------------------------------------------- learner

    def wait_ready(self, deadline_s: float = 30.0) -> None:
        pass  # nothing to connect to

    def get_batch(self, num_groups: int, timeout_s: float,
                  learner_version: Optional[int] = None,
                  max_lag: Optional[int] = None) -> Optional[Batch]:
        batch = self.core.get_batch(num_groups, timeout_s, self.session_id, uuid.uuid4().hex,
                                    learner_version, max_lag=max_lag)
        if batch is None:
            return None
        pieces = [pb.GetBatchResponse.FromString(p) for p in batch.pieces]
        rollouts = [rollout_from_pb(m) for piece in pieces for m in piece.rollouts]
        return Batch(batch.batch_id, rollouts, batch.num_groups, batch.learner_version,
                     batch.delivery_count > 1, batch.delivery_count)

    def ack(self, batch_ids: Sequence[str], timeout_s: float = 60.0) -> int:
        return self.core.ack(list(batch_ids))[0]

    def set_version(self, version: int, timeout_s: float = 60.0,
                    max_lag: Optional[int] = None) -> int:
        return self.core.set_version(version, max_lag)

    def close(self) -> None:
        self.core.close()
