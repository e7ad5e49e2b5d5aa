"""The in-process queue (transport/local_queue.py): what goes in comes out as a gRPC client
would receive it, and the server's boundary checks apply."""
import numpy as np
import pytest

from pipelinerl_jax.transport.codec import InvalidRollout, Limits
from pipelinerl_jax.transport.local_queue import LocalQueue
from pipelinerl_jax.transport.queue_core import QueueCore
from tests.transport.transport_testlib import make_group


def _queue(**limits):
    return LocalQueue(QueueCore(), Limits(**limits))


def test_groups_come_back_as_whole_batches_with_every_field():
    q = _queue()
    q.producer_id = "w0-test"
    q.set_version(0)
    groups = [make_group(f"g{i}", 3) for i in range(2)]
    for g in groups:
        q.put_group(g)
    assert q.stats()["ready_groups"] == 2
    batch = q.get_batch(2, timeout_s=1.0, learner_version=0)
    assert batch.num_groups == 2 and not batch.redelivered and batch.delivery_count == 1
    sent = [r for g in groups for r in g]
    assert len(batch.rollouts) == len(sent)
    for a, b in zip(batch.rollouts, sent):
        assert a.group_id == b.group_id and a.metrics == b.metrics
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_array_equal(a.logp_behaviour, b.logp_behaviour)
        assert a.logp_behaviour.dtype == np.float32 and a.version.dtype == np.int32
    assert q.ack([batch.batch_id]) == 1
    assert q.get_batch(1, timeout_s=0.01) is None  # nothing left


def test_the_servers_boundary_checks_apply():
    q = _queue(vocab_size=20)  # make_rollout's completion ids reach 35
    q.set_version(0)
    with pytest.raises(InvalidRollout, match="completion_ids"):
        q.put_group(make_group("bad", 2))
    with pytest.raises(ValueError, match="one whole group"):
        q.put_group(make_group("half", 2)[:1])
