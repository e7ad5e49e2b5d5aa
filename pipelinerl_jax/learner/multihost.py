"""A learner as P processes (one per host) on one global mesh, with JAX's own multi-controller
runtime (`jax.distributed`; gloo collectives on CPU, the same code path as a TPU pod or
multi-GPU hosts).

Every process runs the same program (`run_learner`): the same jitted step on the same global
batch, the same checkpoint saves and restores (orbax multi-host), the same decisions. What
differs is only what a process sends out of the group, and that is decided here, in one place:

    primary_or(make, stand_in)        # process 0: make(); every other process: stand_in

Process 0 (the primary) pulls batches, announces versions, publishes weights, acknowledges
batches, evaluates and writes metrics, TensorBoard, batches.jsonl and events; the others hold
stand-ins (`NullQueue`, `Silent`, `transport.weight_sink.NullSink`) that do nothing.

The batch: process 0 pulls it from the queue and it travels to the others in one broadcast, as
the queue's own wire bytes (`BatchFeed`). Why not a per-process pull of a deterministic shard:
the queue hands out whole groups at-least-once, with a batch id that is acknowledged only once
a checkpoint covers it; P independent consumers would need P coordinated deliveries, P
redelivery states and agreement on which shards a crashed step trained. One pull keeps one
consumer, one batch id and one ack. Cost at 64 hosts: the broadcast is an all-reduce of the
batch bytes (~2x the bytes per host in a ring, independent of the host count, plus latency
growing with it): for 512 sequences x 4k tokens, ~16 MiB of token ids and log-probs, tens of
milliseconds over a data-center network against a step of seconds; every host then keeps only
its own rows on its devices (`train_step.place_batch`).

Gloo creates a communicator on the first collective over a set of devices and gives the other
processes 30 s to join it; later collectives wait longer. Processes therefore meet at a
coordination-service barrier (generous timeout) before each batch exchange and before the
first checkpoint operation, so that slow primary-only work (an evaluation, a slow queue, a
compile) never runs into that limit.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.metrics import MetricsWriter, append_jsonl
from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import rollout_from_pb, rollout_to_pb
from pipelinerl_jax.transport.queue_client import Batch, QueueUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

BARRIER_TIMEOUT_S = 3600  # the longest a process waits for the others at a barrier


# ============================================================================ joining

def initialize(num_processes: int) -> None:
    """Joins this learner process to its `jax.distributed` group (before any other JAX use).

    `num_processes` (`launch.learner_processes`) > 1, or `JAX_COORDINATOR_ADDRESS` set, joins;
    the coordinator address comes from `JAX_COORDINATOR_ADDRESS` and this process's index from
    `JAX_PROCESS_ID` (the launcher sets both; on real hosts, you do), or from the cluster
    (Cloud TPU, SLURM, ...) where JAX detects them. One process: nothing happens.
    """
    env = os.environ
    if num_processes <= 1 and not env.get("JAX_COORDINATOR_ADDRESS"):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; else unused
    # Its SIGTERM handler would replace ours: a stopped learner must checkpoint and exit.
    jax.config.update("jax_enable_preemption_service", False)
    count = num_processes if num_processes > 1 else _env_int("JAX_NUM_PROCESSES")
    jax.distributed.initialize(num_processes=count, process_id=_env_int("JAX_PROCESS_ID"))
    if num_processes > 1 and jax.process_count() != num_processes:
        raise RuntimeError(f"launch.learner_processes={num_processes} but jax.distributed "
                           f"joined {jax.process_count()} processes")
    log.info("learner process %d of %d (%d local devices, %d in all)", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def check_mesh(shape) -> None:
    """A multi-process mesh must span every process's devices (each holds a part)."""
    n = int(np.prod(shape))
    if jax.process_count() > 1 and n != jax.device_count():
        raise ValueError(f"mesh.shape={tuple(shape)} has {n} devices but the "
                         f"{jax.process_count()} learner processes hold {jax.device_count()} "
                         f"({jax.local_device_count()} each): they must be equal")


def barrier(name: str) -> None:
    """All processes meet here (coordination service; no device collective). Each name is
    used once per run of the group."""
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp  # the coordination-service barrier
        ocp.multihost.get_barrier_sync_fn()(key=f"pipelinerl:{name}",
                                            timeout_ms=BARRIER_TIMEOUT_S * 1000)


# ============================================================================ the one guard

def primary_or(make: Callable[[], T], stand_in: T) -> T:
    """`make()` on process 0, `stand_in` on every other process: the one place where a
    process's index decides what it does."""
    return make() if jax.process_index() == 0 else stand_in


class NullQueue:
    """The queue as a non-primary process sees it: nothing to pull, nobody to tell."""

    def get_batch(self, *args, **kwargs):
        return None

    def set_version(self, *args, **kwargs):
        return 0

    def ack(self, *args, **kwargs):
        return 0

    def wait_ready(self, *args, **kwargs):
        pass

    def close(self):
        pass


class RunFiles:
    """What the learner writes into its workdir: `metrics.jsonl` + TensorBoard,
    `batches.jsonl` (the audit trail) and `learner_done.jsonl`."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.writer = MetricsWriter(workdir)

    def metrics(self, step: int, record: dict) -> None:
        self.writer.write(step, record)

    def batch(self, record: dict) -> None:
        append_jsonl(os.path.join(self.workdir, "batches.jsonl"), [record])

    def done(self, record: dict) -> None:
        append_jsonl(os.path.join(self.workdir, "learner_done.jsonl"), [record])

    def close(self) -> None:
        self.writer.close()


class Silent:
    """`RunFiles` of a non-primary process: writes nothing."""

    def metrics(self, step: int, record: dict) -> None:
        pass

    def batch(self, record: dict) -> None:
        pass

    def done(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


# ============================================================================ the batch

def encode_batch(batch: Batch) -> bytes:
    """A queue batch as the queue's own wire message (never pickle)."""
    return pb.GetBatchResponse(
        batch_id=batch.batch_id, rollouts=[rollout_to_pb(r) for r in batch.rollouts],
        num_groups=batch.num_groups, redelivered=batch.redelivered,
        delivery_count=batch.delivery_count,
        learner_version=batch.learner_version).SerializeToString()


def decode_batch(data: bytes) -> Batch:
    m = pb.GetBatchResponse.FromString(data)
    return Batch(m.batch_id, [rollout_from_pb(r) for r in m.rollouts], m.num_groups,
                 m.learner_version, m.redelivered, m.delivery_count)


def _bucket(n: int) -> int:
    """Byte-buffer sizes rounded up to powers of two: one broadcast compilation per size."""
    return max(4096, 1 << (n - 1).bit_length())


class BatchFeed:
    """The same batch for every process: process 0 pulls it from `queue` (others hold a
    `NullQueue`), then it is broadcast. Any process's stop request stops all of them.

    `unavailable`: how many pulls found the queue unreachable (process 0's count)."""

    def __init__(self, queue):
        self.queue = queue
        self.unavailable = 0
        self._exchanges = 0

    def next(self, num_groups: int, timeout_s: float, version: int,
             stop: bool, max_lag: Optional[int] = None) -> Tuple[Optional[Batch], bool]:
        """(batch or None, whether to stop). `max_lag`, if given, is announced with the
        version (closed-loop staleness control)."""
        batch = None
        if not stop:
            try:
                batch = self.queue.get_batch(num_groups, timeout_s=timeout_s,
                                             learner_version=version,
                                             **({} if max_lag is None else {"max_lag": max_lag}))
            except QueueUnavailable as e:  # the queue is down or restarting: wait for it
                self.unavailable += 1
                log.warning("queue unavailable (%s); retrying", e)
        if jax.process_count() == 1:
            return batch, stop
        return self._share(batch, stop)

    def _share(self, batch: Optional[Batch], stop: bool) -> Tuple[Optional[Batch], bool]:
        from jax.experimental import multihost_utils  # multi-process only
        self._exchanges += 1
        barrier(f"batch-{self._exchanges}")
        data = encode_batch(batch) if batch is not None else b""
        heads = multihost_utils.process_allgather(np.array([int(stop), len(data)], np.int32))
        if heads[:, 0].any():
            return None, True  # a pulled batch stays unacknowledged: the queue redelivers it
        size = int(heads[0, 1])
        if size == 0:
            return None, False
        buf = np.zeros(_bucket(size), np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        buf = multihost_utils.broadcast_one_to_all(buf)
        return decode_batch(buf[:size].tobytes()), False


# ============================================================================ params to host

def host_params(params):
    """The param tree as host arrays on every process. A leaf sharded across processes is
    replicated over its mesh and fetched one leaf at a time (device memory peaks at one full
    leaf, not one full model); all processes must call this together."""
    leaves = jax.tree.leaves(params)
    if all(x.is_fully_addressable for x in leaves):
        return jax.device_get(params)  # one process: one batched copy

    def one(x):
        if not x.is_fully_replicated:
            x = _replicate(x.sharding.mesh)(x)
        return np.asarray(x.addressable_data(0))
    return jax.tree.map(one, params)


def snapshot_params(params, on_device: Optional[bool] = None, dtype=None):
    """What a background thread may turn into host arrays while the next (donating) train
    step runs: when every leaf is addressable here, an on-device copy (dispatched, not waited
    for; its device-to-host copy already started); otherwise `host_params` itself, since its
    collectives must run in the same order on every process (the main thread's). CPU arrays
    are host memory already: fetched at once (no copy to make) unless `on_device`.

    `dtype` (`learner.publish_dtype`, resolved by `run_config.publish_dtype`): floating
    leaves are cast to it, on the device in the same program as the copy (a bf16 snapshot of
    float32 params is half the HBM and half the bytes to host and on the wire), or on the
    host after `host_params`. Round to nearest even either way, the cast an engine of that
    dtype would make itself on receipt, so what it serves is bit-identical."""
    leaves = jax.tree.leaves(params)
    if on_device is None:
        on_device = not all(d.platform == "cpu" for x in leaves for d in x.devices())
    if not on_device or not all(x.is_fully_addressable for x in leaves):
        return cast_floats(host_params(params), dtype)
    snap = snapshot_program(None if dtype is None else np.dtype(dtype))(params)
    for x in jax.tree.leaves(snap):
        x.copy_to_host_async()
    return snap


def _cast(x, dtype):
    if dtype is None or x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


def cast_floats(tree, dtype):
    """`tree` with its floating leaves cast to `dtype` (None: `tree` itself)."""
    return tree if dtype is None else jax.tree.map(lambda x: _cast(x, dtype), tree)


@functools.lru_cache(maxsize=None)
def snapshot_program(dtype):
    """A jitted copy of a param tree (copy: no input forwarding), floats cast to `dtype`."""
    return jax.jit(lambda tree: jax.tree.map(lambda x: jnp.copy(_cast(x, dtype)), tree))


_REPLICATORS: dict = {}


def _replicate(mesh):
    if mesh not in _REPLICATORS:
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        _REPLICATORS[mesh] = jax.jit(lambda x: x, out_shardings=rep)
    return _REPLICATORS[mesh]
