"""The queue's state machine without gRPC: groups, capacity, staleness, at-least-once."""
import pytest

from pipelinerl_jax.transport.codec import Limits, rollout_to_pb, validate_rollout
from pipelinerl_jax.transport.queue_core import (
    GroupRejected, NoVersionYet, QueueCore, QueueFull, SessionSuperseded)
from transport_testlib import make_group, make_rollout


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def put(core, rollouts, request_id="", hold_s=0.0):
    msgs = [rollout_to_pb(r) for r in rollouts]
    infos = [validate_rollout(m, Limits(), core.learner_version) for m in msgs]
    return core.put([m.SerializeToString() for m in msgs], infos, request_id, hold_s)


def members(batch):
    from pipelinerl_jax.transport import rollout_pb2 as pb
    out = []
    for piece in batch.pieces:
        out += [(m.group_id, int(m.metrics["member"]))
                for m in pb.GetBatchResponse.FromString(piece).rollouts]
    return out


def test_group_arriving_in_pieces_is_delivered_only_when_whole():
    core = QueueCore(capacity_rollouts=16)
    core.set_version(0)
    g = make_group("a", 3)
    put(core, g[:1])
    put(core, make_group("b", 2))
    assert core.get_batch(2, 0.0, "s") is None  # "a" incomplete: only one ready group
    put(core, g[1:])
    batch = core.get_batch(2, 0.0, "s")
    assert sorted(members(batch)) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert batch.num_groups == 2 and batch.num_rollouts == 5


def test_group_membership_errors_name_the_field():
    core = QueueCore()
    core.set_version(0)
    put(core, make_group("a", 2)[:1])
    with pytest.raises(GroupRejected, match=r"rollouts\[0\].group_size"):
        put(core, [make_rollout("a", 3)])
    with pytest.raises(GroupRejected, match=r"rollouts\[0\].group_id.*3 members"):
        put(core, make_group("a", 2))
    put(core, make_group("a", 2)[1:])
    with pytest.raises(GroupRejected, match="already complete"):
        put(core, make_group("a", 2)[:1])
    with pytest.raises(GroupRejected, match="exceeds queue capacity"):
        QueueCore(capacity_rollouts=4).put(
            [rollout_to_pb(make_rollout("z", 5)).SerializeToString()],
            [validate_rollout(rollout_to_pb(make_rollout("z", 5)), Limits(), None)])


def test_incomplete_groups_expire_and_free_their_room():
    clock = Clock()
    core = QueueCore(capacity_rollouts=4, incomplete_group_timeout_s=10.0, clock=clock)
    core.set_version(0)
    put(core, make_group("dead", 4)[:1])  # its producer died: reserves 4 slots
    with pytest.raises(QueueFull):
        put(core, make_group("live", 2))
    clock.t = 11.0
    put(core, make_group("live", 2))
    stats = core.stats()
    assert stats.dropped_groups["incomplete_timeout"] == 1
    assert stats.dropped_rollouts["incomplete_timeout"] == 1
    err = pytest.raises(GroupRejected, put, core, make_group("dead", 4)[1:]).value
    assert err.expired and "expired" in str(err)


def test_capacity_counts_pending_ready_and_outstanding():
    core = QueueCore(capacity_rollouts=6)
    core.set_version(0)
    put(core, make_group("a", 2))
    put(core, make_group("b", 4)[:1])  # reserves all 4 slots of "b"
    with pytest.raises(QueueFull):
        put(core, make_group("c", 1))
    put(core, make_group("b", 4)[1:])  # a started group can always finish
    batch = core.get_batch(2, 0.0, "s")
    with pytest.raises(QueueFull):  # delivered but unacked rollouts still count
        put(core, make_group("c", 1))
    core.ack([batch.batch_id])
    put(core, make_group("c", 1))
    s = core.stats()
    assert s.max_held_rollouts == 6 and s.held_rollouts == 1 and s.put_refused_full == 2


def test_duplicate_request_id_is_stored_once():
    core = QueueCore()
    core.set_version(0)
    assert put(core, make_group("a", 2), request_id="r1") == (2, False)
    assert put(core, make_group("a", 2), request_id="r1") == (0, True)
    assert core.stats().put_duplicates == 1


def test_version_checks():
    core = QueueCore()
    with pytest.raises(NoVersionYet):  # version > 0 before any announcement
        put(core, make_group("a", 1, version=1))
    put(core, make_group("b", 1, version=0))  # version 0 needs no announcement
    core.set_version(3)
    put(core, make_group("a", 1, version=3))


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_staleness_policy_and_exact_lag_counts(policy):
    core = QueueCore(max_lag=2, stale_policy=policy)
    core.set_version(5)
    for i, v in enumerate([5, 4, 3, 2, 1, 5]):  # lags at version 5: 0 1 2 3 4 0
        put(core, make_group(f"v{v}-{i}", 2, version=v))
    got = []
    while (batch := core.get_batch(1, 0.0, "s", learner_version=5)) is not None:
        got += [gid for gid, _ in members(batch)]
    s = core.stats()
    if policy == "drop":
        assert sorted(set(got)) == ["v3-2", "v4-1", "v5-0", "v5-5"]
        assert s.dropped_groups["stale"] == 2 and s.dropped_rollouts["stale"] == 4
        assert dict(s.lag_histogram) == {0: 2, 1: 1, 2: 1}
    else:
        assert len(set(got)) == 6 and s.stale_kept_groups == 2
        assert dict(s.lag_histogram) == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1}
    assert s.held_rollouts == 2 * len(set(got))  # delivered, not acked


def test_lag_uses_the_oldest_token_of_the_group():
    core = QueueCore(max_lag=1)
    core.set_version(4)
    g = make_group("mixed", 2, version=4)
    g[1].version[:2] = 2
    g[1].kv_version[:2] = 2
    put(core, g)
    assert core.get_batch(1, 0.0, "s") is None
    assert core.stats().dropped_groups["stale"] == 1


def test_rollback_drops_groups_from_the_future():
    core = QueueCore()
    core.set_version(7)
    put(core, make_group("new", 1, version=7))
    core.set_version(5)  # learner restarted from an older checkpoint
    assert core.get_batch(1, 0.0, "s") is None
    assert core.stats().dropped_groups["future"] == 1


def test_at_least_once_redelivery_to_a_new_session():
    core = QueueCore()
    core.set_version(0)
    for i in range(4):
        put(core, make_group(f"g{i}", 2))
    b1 = core.get_batch(1, 0.0, "s1")
    b2 = core.get_batch(1, 0.0, "s1")
    b3 = core.get_batch(1, 0.0, "s1")
    core.ack([b2.batch_id])
    # The learner restarts: new session. b1 and b3 come back first, same ids and bytes,
    # in delivery order; b2 (acked) never does; then new data.
    r1 = core.get_batch(1, 0.0, "s2")
    r3 = core.get_batch(1, 0.0, "s2")
    assert (r1.batch_id, r1.pieces, r1.delivery_count) == (b1.batch_id, b1.pieces, 2)
    assert (r3.batch_id, r3.pieces) == (b3.batch_id, b3.pieces)
    fresh = core.get_batch(1, 0.0, "s2")
    assert fresh.batch_id not in {b1.batch_id, b2.batch_id, b3.batch_id}
    assert members(fresh) == [("g3", 0), ("g3", 1)]
    assert core.get_batch(1, 0.0, "s2") is None
    with pytest.raises(SessionSuperseded):  # the old learner is fenced off
        core.get_batch(1, 0.0, "s1")
    assert core.ack([b1.batch_id, b1.batch_id, "other-server-1"]) == (
        1, [b1.batch_id, "other-server-1"])
    s = core.stats()
    assert (s.batches_delivered, s.batches_redelivered, s.batches_acked, s.sessions) == (
        4, 2, 2, 2)
    assert (s.get_requests, s.get_empty) == (8, 1)  # the fenced call is counted, not served


def test_ack_before_redelivery_cancels_it():
    core = QueueCore()
    core.set_version(0)
    put(core, make_group("g", 1))
    b = core.get_batch(1, 0.0, "s1")
    core.ack([b.batch_id])  # e.g. the new learner found it in its checkpoint
    assert core.get_batch(1, 0.0, "s2") is None


def test_retried_get_returns_the_same_batch():
    core = QueueCore()
    core.set_version(0)
    put(core, make_group("g0", 1))
    put(core, make_group("g1", 1))
    b = core.get_batch(1, 0.0, "s", request_id="req-1")
    again = core.get_batch(1, 0.0, "s", request_id="req-1")  # response was lost
    assert again.batch_id == b.batch_id
    assert members(core.get_batch(1, 0.0, "s", request_id="req-2")) == [("g1", 0)]


def test_large_batches_stream_in_pieces(monkeypatch):
    from pipelinerl_jax.transport import queue_core
    monkeypatch.setattr(queue_core, "PIECE_BYTES", 600)
    core = QueueCore()
    core.set_version(0)
    put(core, make_group("g", 8, completion=20))
    batch = core.get_batch(1, 0.0, "s")
    assert len(batch.pieces) > 1
    assert sorted(members(batch)) == [("g", i) for i in range(8)]


def test_only_a_few_puts_may_hold_server_threads():
    import threading
    core = QueueCore(capacity_rollouts=1, max_concurrent_holds=1)
    core.set_version(0)
    put(core, make_group("full", 1))
    holder = threading.Thread(target=lambda: pytest.raises(QueueFull, put, core,
                                                           make_group("a", 1), hold_s=2.0))
    holder.start()
    while core._holding == 0:
        pass
    with pytest.raises(QueueFull):  # the one hold slot is taken: refused at once, ...
        put(core, make_group("b", 1), hold_s=10.0)
    assert holder.is_alive()  # ... i.e. while the first put is still being held
    holder.join()
    assert core._holding == 0 and core.stats().put_refused_full == 2
