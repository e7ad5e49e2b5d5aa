"""The queue's side of closed-loop staleness control: the learner moves `max_lag` with its
version (SetVersion, GetBatch), the queue applies and reports it, and counts every dropped
group for the producer that put it."""
import grpc
import pytest

from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer, RolloutRejected
from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.codec import Limits, rollout_to_pb, validate_rollout
from pipelinerl_jax.transport.queue_core import QueueCore
from transport_testlib import make_group


def put(core, rollouts, producer_id=""):
    msgs = [rollout_to_pb(r) for r in rollouts]
    infos = [validate_rollout(m, Limits(), core.learner_version) for m in msgs]
    return core.put([m.SerializeToString() for m in msgs], infos, producer_id=producer_id)


def test_core_applies_the_announced_limit_and_counts_drops_per_producer():
    core = QueueCore(capacity_rollouts=64, max_lag=4)
    core.set_version(0)
    assert core.stats().max_lag == 4
    for i in range(3):
        put(core, make_group(f"a{i}", 2, version=0), producer_id="wA")
    put(core, make_group("b0", 2, version=0), producer_id="wB")
    core.set_version(2, max_lag=1)  # the limit drops: the version-0 groups are now stale
    assert core.stats().max_lag == 1
    put(core, make_group("c0", 2, version=2))  # no producer id: counted only in the totals
    batch = core.get_batch(1, 0.0, "s")
    assert batch is not None and batch.num_groups == 1  # c0, lag 0
    s = core.stats(producer_id="wA")
    assert s.dropped_groups["stale"] == 4 and s.producer_dropped_groups == 3
    assert core.stats(producer_id="wB").producer_dropped_groups == 1
    assert core.stats(producer_id="nobody").producer_dropped_groups == 0
    assert core.stats().producer_dropped_groups == 0
    # GetBatch announces a limit too (a restarted queue learns it with the next call)
    put(core, make_group("a9", 2, version=2), producer_id="wA")
    assert core.get_batch(1, 0.0, "s", learner_version=3, max_lag=0) is None
    assert core.max_lag == 0 and core.stats(producer_id="wA").producer_dropped_groups == 4
    core.set_version(3)  # no limit given: unchanged
    assert core.max_lag == 0
    with pytest.raises(ValueError, match="max_lag"):
        core.set_version(3, max_lag=-1)


def test_unlimited_queue_reports_minus_one_and_learns_a_limit():
    core = QueueCore(max_lag=None)
    assert core.stats().max_lag == -1
    core.set_version(0, max_lag=2)
    assert core.stats().max_lag == 2


def test_limit_and_producer_counts_over_grpc():
    with RolloutQueueServer(max_lag=3) as server:
        learner, worker = RolloutQueueClient(server.address), RolloutQueueClient(server.address)
        worker.producer_id = "w0-abc"
        try:
            learner.set_version(0, max_lag=3)
            worker.put_group(make_group("g1", 2, version=0))
            assert worker.stats()["max_lag"] == 3
            assert learner.get_batch(1, timeout_s=0.2, learner_version=1, max_lag=0) is None
            stats = worker.stats()
            assert stats["max_lag"] == 0 and stats["producer_dropped_groups"] == 1
            assert learner.stats()["producer_dropped_groups"] == 0  # not its groups
            learner.set_version(1, max_lag=2)
            assert worker.stats()["max_lag"] == 2
            # bad values are refused with the field named
            with pytest.raises(RolloutRejected, match="max_lag"):
                learner.set_version(1, max_lag=-1)
            with pytest.raises(RolloutRejected, match="max_lag"):
                learner.get_batch(1, timeout_s=0.1, learner_version=1, max_lag=-2)
            worker.producer_id = "x" * 129
            with pytest.raises(RolloutRejected) as e:
                worker.put_group(make_group("g2", 2, version=1))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.field == "producer_id"
        finally:
            learner.close()
            worker.close()


def test_old_requests_without_the_new_fields_mean_no_change():
    """proto3 optional: a SetVersion without max_lag leaves the limit alone."""
    assert not pb.SetVersionRequest(version=1).HasField("max_lag")
    assert not pb.GetBatchRequest(num_groups=1).HasField("max_lag")
    assert pb.SetVersionRequest(version=1, max_lag=0).HasField("max_lag")
