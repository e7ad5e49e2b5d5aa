"""Property-based fuzzing at scale of every request type at the queue's boundary and of the
weight stream's frames (>= 10,000 generated cases per run, about a minute).

The queue is fuzzed through `RolloutQueueServer.handlers`, the very functions gRPC calls,
in-process (no sockets: thousands of cases a second instead of hundreds), with a stand-in
context whose `abort` raises as gRPC's does. Properties:
- every answer is a parsed response or an abort with an allowed code and a
  "<field>: <why>" message; nothing else escapes a handler (gRPC would answer UNKNOWN);
- a rollout is stored exactly when the independent oracle (`hostile.problems`) and the id
  caps say it is valid; every delivered piece fits `max_message_bytes`;
- no bad row and no partial group ever reaches a consumer (checked on every delivery and
  by a final drain).
The weight stream is fuzzed through `weights._StreamReader` (what the subscriber thread runs
per frame): frames of real versions mutated at the byte, field and sequence level, plus
arbitrary bytes. A frame either advances a version or raises `_CorruptVersion`, nothing
else; a completed version has the names and shapes the subscriber expects, and with crc32
on, exactly the published values. A last test sends hostile streams over gRPC to a real
subscriber, whose thread must survive all of them and apply the good version after them.
Known hostile inputs are kept as explicit examples (`@example`) and as named tests in
tests/transport/test_transport_hardening.py. Case counts are printed (`[fuzz] ...`).
"""
import collections
import random
from concurrent import futures

import grpc
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport import weights, wire
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.transport.codec import Limits
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.queue_server import MAX_ID_CHARS, RolloutQueueServer
from tests.transport.flat_weights import FlatSubscriber as WeightSubscriber
from tests.reliability import hostile
from tests.reliability.hostile import ANNOUNCED, problems
from tests.transport.fake_weight_stream import ScriptedPublisher
from tests.transport.transport_testlib import HandlerContext

pytestmark = pytest.mark.slow  # a fuzz campaign (~10,000 cases), not inner-loop material

COUNTS = collections.Counter()
MIB = 1 << 20
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None,
                derandomize=True)
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
REFUSALS = {INVALID, grpc.StatusCode.FAILED_PRECONDITION}


def _server(**kw) -> RolloutQueueServer:
    """A queue whose handlers are called in-process (never started: no sockets)."""
    server = RolloutQueueServer(
        limits=Limits(vocab_size=hostile.VOCAB, max_prompt_tokens=hostile.MAX_PROMPT,
                      max_completion_tokens=hostile.MAX_COMPLETION,
                      max_group_size=hostile.MAX_GROUP),
        capacity_rollouts=1 << 20, incomplete_group_timeout_s=3600.0, max_message_bytes=MIB,
        **kw)
    assert _call(server, "SetVersion", pb.SetVersionRequest(version=ANNOUNCED))[0] == OK
    return server


def _call(server, method: str, request):
    """(code, response or details) of one in-process call; raw bytes or a message."""
    handler = server.handlers[method]
    ctx = HandlerContext()
    try:
        if method == "PutStream":
            raws = [r if isinstance(r, bytes) else r.SerializeToString() for r in request]
            return OK, list(handler.stream_stream(iter(raws), ctx))
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        if handler.response_streaming:
            return OK, list(handler.unary_stream(raw, ctx))
        return OK, handler.unary_unary(raw, ctx)
    except HandlerContext.Aborted as e:
        assert ": " in e.details, (method, e.code, e.details)
        return e.code, e.details


@pytest.fixture(scope="module")
def queue():
    server = _server()
    yield server
    server.core.close()


def _check_delivery(pieces: list) -> int:
    """Every piece fits the limit; every row valid; whole groups. Returns rows seen."""
    rows = [m for raw in pieces for m in pb.GetBatchResponse.FromString(raw).rollouts]
    assert all(len(raw) <= MIB for raw in pieces)
    members = collections.Counter(m.group_id for m in rows)
    for m in rows:
        assert not problems(m), f"delivered a bad row: {problems(m)}"
        assert members[m.group_id] == m.group_size, "delivered a partial group"
    return len(rows)


# ------------------------------------------------------------------ queue: every request type

@settings(FUZZ, max_examples=200)
@given(hostile.rollouts(), st.one_of(st.text(max_size=12), st.text(
    min_size=MAX_ID_CHARS - 2, max_size=MAX_ID_CHARS + 3)), st.text(max_size=MAX_ID_CHARS + 3),
       st.one_of(st.floats(allow_nan=True), st.sampled_from([0.0, -1.0])),
       st.binary(max_size=64))
def test_fuzz_put_requests(queue, m, request_id, producer_id, hold_s, unknown):
    if m.group_id == "g":
        m.group_id = f"g{COUNTS['put']}"  # every fuzzed rollout starts its own group
    COUNTS["put"] += 1
    raw = pb.PutRequest(rollouts=[m], request_id=request_id, producer_id=producer_id,
                        hold_s=hold_s).SerializeToString()
    raw += wire.len_field(999, len(unknown)) + unknown  # an unknown field: dropped
    bad = problems(m)
    too_long = [f for f, v in (("request_id", request_id), ("producer_id", producer_id))
                if len(v) > MAX_ID_CHARS]
    duplicate = bool(request_id) and request_id in queue.core._requests
    code, out = _call(queue, "Put", raw)
    if not bad and not too_long:
        assert code == OK, out
        assert out.accepted == (0 if duplicate else 1) and out.duplicate == duplicate
        COUNTS["put_stored" if not duplicate else "put_duplicate"] += 1
        return
    assert code == INVALID, (code, out, bad, too_long)
    field = out.split(":")[0]
    assert field in too_long or any(field.startswith(f"rollouts[0].{b}") for b in bad), \
        (out, bad, too_long)
    COUNTS["put_refused"] += 1


def _valid_request(i: int, size: int = 2) -> bytes:
    msgs = []
    for k in range(size):
        m = pb.Rollout(group_id=f"bytes{i}", group_size=size, finish_reason="stop",
                       start_version=ANNOUNCED, reward=1.0)
        for name, values in (("prompt_ids", [1, 2]), ("completion_ids", [3, k]),
                             ("logp_behaviour", [-0.5, -1.0]), ("version", [ANNOUNCED] * 2),
                             ("kv_version", [ANNOUNCED] * 2)):
            a = getattr(m, name)
            a.dtype = hostile.ARRAYS[name]
            a.shape[:] = [2]
            a.data = np.asarray(values, a.dtype).tobytes()
        msgs.append(m)
    return pb.PutRequest(rollouts=msgs, request_id=f"r{i}").SerializeToString()


def mutate(raw: bytes, rng: random.Random) -> bytes:
    """1-4 byte-level mutations of `raw`: truncate, flip a bit, insert random bytes, delete,
    or splice in a piece of itself. (Cases are drawn by hypothesis as a seed: one draw per
    case instead of one per decision keeps thousands of cases within seconds.)"""
    out = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["truncate", "flip", "insert", "delete", "splice"])
        i = rng.randrange(max(1, len(out)))
        if op == "truncate":
            del out[i:]
        elif op == "flip" and out:
            out[i] ^= 1 << rng.randrange(8)
        elif op == "insert":
            out[i:i] = rng.randbytes(rng.randint(1, 12))
        elif op == "delete":
            del out[i:i + rng.randint(1, 8)]
        elif op == "splice" and out:
            j = rng.randrange(len(out))
            out[i:i] = out[j:j + rng.randint(1, 16)]
    return bytes(out)


SEEDS = st.integers(0, 2**32 - 1)


@settings(FUZZ, max_examples=3000)
@given(SEEDS, st.booleans())
def test_fuzz_put_bytes(queue, seed, arbitrary):
    COUNTS["put_bytes"] += 1
    rng = random.Random(seed)
    raw = rng.randbytes(rng.randint(0, 200)) if arbitrary else \
        mutate(_valid_request(seed), rng)
    code, out = _call(queue, "Put", raw)
    assert code in {OK} | REFUSALS, (code, out)
    COUNTS["put_bytes_stored" if code == OK else "put_bytes_refused"] += 1


@settings(FUZZ, max_examples=400)
@given(SEEDS, st.integers(1, 5))
def test_fuzz_put_stream(queue, seed, n):
    rng = random.Random(seed)
    raws = []
    for k in range(n):  # valid requests, mutated ones, arbitrary bytes
        raw = _valid_request(10**10 + seed * 10 + k)
        raws.append(rng.choice([raw, mutate(raw, rng), rng.randbytes(rng.randint(0, 80))]))
    COUNTS["put_stream"] += 1
    code, responses = _call(queue, "PutStream", raws)
    assert code == OK and len(responses) == len(raws)
    for r in responses:
        assert r.code in (0, INVALID.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0])
        assert r.code == 0 or (r.message.startswith(r.field + ": ") if r.field else r.message)
        COUNTS["put_stream_items"] += 1


BATCH_IDS: list = []


def _id(rng: random.Random) -> str:
    """An id of a length around and far beyond the cap, ASCII or not."""
    n = rng.choice([0, rng.randint(1, 12), MAX_ID_CHARS - 1, MAX_ID_CHARS, MAX_ID_CHARS + 1,
                    10_000])
    return "".join(rng.choice("ab-_9é\u4e2d\x00") for _ in range(n))


@settings(FUZZ, max_examples=1000)
@given(SEEDS)
def test_fuzz_get_batch(queue, seed):
    COUNTS["get_batch"] += 1
    rng = random.Random(seed)
    if rng.random() < 0.2:
        code, out = _call(queue, "GetBatch", rng.randbytes(rng.randint(0, 40)))
    else:
        request = pb.GetBatchRequest(
            num_groups=rng.randint(-3, 4),
            timeout_s=rng.choice([0.0, -1.0, float("nan"), -float("inf"), 1e-3]),
            session_id=rng.choice(["learner", "other", _id(rng)]), request_id=_id(rng))
        version, max_lag = rng.choice([None, ANNOUNCED, -1]), rng.choice([None, 0, 2, -4])
        if version is not None:
            request.learner_version = version
        if max_lag is not None:
            request.max_lag = max_lag
        code, out = _call(queue, "GetBatch", request)
    assert code in {OK} | REFUSALS, (code, out)
    if code == OK and out:
        COUNTS["get_batch_rows"] += _check_delivery(out)
        BATCH_IDS.append(pb.GetBatchResponse.FromString(out[0]).batch_id)
    COUNTS["get_batch_delivered" if code == OK and out else
           "get_batch_empty" if code == OK else "get_batch_refused"] += 1


@settings(FUZZ, max_examples=1000)
@given(SEEDS)
def test_fuzz_ack(queue, seed):
    COUNTS["ack"] += 1
    rng = random.Random(seed)
    ids = [rng.choice(BATCH_IDS) if BATCH_IDS and rng.random() < 0.5 else _id(rng)
           for _ in range(rng.randint(0, 6))]
    garbage = rng.random() < 0.2
    code, out = _call(queue, "Ack", rng.randbytes(rng.randint(0, 40)) if garbage
                      else pb.AckRequest(batch_ids=ids))
    assert code in {OK, INVALID}, (code, out)
    if code == INVALID and not garbage:
        assert out.startswith("batch_ids[") and any(len(i) > MAX_ID_CHARS for i in ids)


@settings(FUZZ, max_examples=500)
@given(SEEDS)
def test_fuzz_get_stats(queue, seed):
    COUNTS["get_stats"] += 1
    rng = random.Random(seed)
    garbage = rng.random() < 0.2
    code, out = _call(queue, "GetStats", rng.randbytes(rng.randint(0, 40)) if garbage
                      else pb.StatsRequest(producer_id=_id(rng)))
    assert code in {OK, INVALID}, (code, out)
    assert code == INVALID or out.capacity_rollouts == 1 << 20


@settings(FUZZ, max_examples=500)
@given(st.integers(-2**63, 2**63 - 1), st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
       st.booleans(), st.binary(max_size=40))
def test_fuzz_set_version(version_queue, version, max_lag, garbage, raw):
    COUNTS["set_version"] += 1
    request = pb.SetVersionRequest(version=version)
    if max_lag is not None:
        request.max_lag = max_lag
    code, out = _call(version_queue, "SetVersion", raw if garbage else request)
    assert code in {OK, INVALID}, (code, out)
    if not garbage:
        assert (code == OK) == (version >= 0 and (max_lag is None or max_lag >= 0))
    if code == OK and not garbage:
        assert out.version == version


@pytest.fixture(scope="module")
def version_queue(queue):
    """Its own queue: announcing arbitrary versions must not change the others' oracle.
    Holds some groups, so that every announcement runs the staleness and future drops."""
    server = _server()
    for i in range(20):
        assert _call(server, "Put", _valid_request(i, size=1))[0] == OK
    yield server
    code, pieces = _call(server, "GetBatch", pb.GetBatchRequest(
        num_groups=1, session_id="drain", learner_version=ANNOUNCED))
    assert code == OK and (not pieces or _check_delivery(pieces))
    server.core.close()


def test_no_bad_row_or_partial_group_reaches_a_consumer(queue, report):
    """Drains the queue as a new learner session (everything unacked is redelivered) and
    re-checks every row; prints the case counts of this file's queue tests."""
    delivered = groups = 0
    while True:
        code, pieces = _call(queue, "GetBatch", pb.GetBatchRequest(
            num_groups=1, timeout_s=0, session_id="final-learner", learner_version=ANNOUNCED,
            request_id=f"drain{groups}"))
        assert code == OK
        if not pieces:
            break
        delivered += _check_delivery(pieces)
        groups += 1
        batch_id = pb.GetBatchResponse.FromString(pieces[0]).batch_id
        assert _call(queue, "Ack", pb.AckRequest(batch_ids=[batch_id]))[0] == OK
    stats = queue.core.stats()
    assert stats.outstanding_batches == 0 and stats.ready_groups == 0
    assert stats.held_bytes >= 0 and stats.held_rollouts >= 0
    cases = sum(COUNTS[k] for k in ("put", "put_bytes", "put_stream", "get_batch", "ack",
                                    "get_stats", "set_version"))
    COUNTS["queue_cases"] = cases
    report(f"[fuzz] queue handlers: {cases} cases (Put {COUNTS['put']}: "
           f"{COUNTS['put_stored']} stored exactly when valid, {COUNTS['put_refused']} "
           f"refused naming a field, {COUNTS['put_duplicate']} duplicates; Put bytes "
           f"{COUNTS['put_bytes']}: {COUNTS['put_bytes_stored']} stored / "
           f"{COUNTS['put_bytes_refused']} refused; PutStream {COUNTS['put_stream']} "
           f"({COUNTS['put_stream_items']} items); GetBatch {COUNTS['get_batch']} "
           f"({COUNTS['get_batch_delivered']} deliveries, {COUNTS['get_batch_rows']} rows); "
           f"Ack {COUNTS['ack']}; GetStats {COUNTS['get_stats']}; SetVersion "
           f"{COUNTS['set_version']}); final drain: {delivered} rows in {groups} groups, "
           f"0 bad, 0 partial")


# ------------------------------------------------------------------ weight-stream frames

PARAMS = {"embed": np.arange(60, dtype=np.float32).reshape(12, 5),
          "norm": np.ones(7, ml_dtypes.bfloat16), "empty": np.zeros((0, 3), np.int32),
          "scalar": np.float32(3.5) * np.ones((), np.float32)}
EXPECTED = {k: v.shape for k, v in PARAMS.items()}
CRC_POOL = futures.ThreadPoolExecutor(1)
FRAMES = list(weights._Version(WeightVersion("full").carrying(5, tensors=PARAMS), "pub", 64,
                                     CRC_POOL).frames())
PAYLOAD = b"".join(pb.WeightMessage.FromString(f).chunk.data for f in FRAMES[1:-1])


def _huge_header() -> list:  # a header claiming hundreds of GiB
    n = 900 << 30
    h = pb.WeightHeader(kind="full", version=7, publisher_id="p", total_bytes=n, num_chunks=1)
    h.tensors.add(name="embed", dtype="uint8", shape=[n], offset=0, nbytes=n)
    return [pb.WeightMessage(header=h).SerializeToString()]


def _varint_data() -> list:  # a chunk's data field with another wire type
    body = pb.WeightChunk(version=5, index=0, offset=0).SerializeToString() + b"\x28\x05"
    return [FRAMES[0], wire.len_field(2, len(body)) + body, *FRAMES[2:]]


def _big(rng: random.Random) -> int:
    return rng.choice([rng.randint(-2**63, 2**63 - 1), rng.randint(-3, 300), 900 << 30])


def edit_header(raw: bytes, rng: random.Random) -> bytes:
    """1-3 field edits of a WeightHeader frame: sizes, counts, shapes, dtypes, offsets,
    names, the crc flag, tensors dropped or added."""
    header = pb.WeightMessage.FromString(raw).header
    for _ in range(rng.randint(1, 3)):
        what = rng.choice(["total", "chunks", "shape", "dtype", "offset", "nbytes", "name",
                           "crc", "drop", "add"])
        t = rng.choice(header.tensors) if header.tensors else None
        if what == "total":
            header.total_bytes = _big(rng)
        elif what == "chunks":
            header.num_chunks = rng.randint(-2**31, 2**31 - 1)
        elif what == "crc":
            header.has_crc32 = not header.has_crc32
        elif what == "drop" and t is not None:
            header.tensors.remove(t)
        elif what == "add":
            header.tensors.add(name=rng.choice(["x", "", "embed"]), dtype="float32",
                               shape=[_big(rng) for _ in range(rng.randint(0, 3))],
                               offset=_big(rng), nbytes=_big(rng))
        elif t is not None:
            if what == "shape":
                t.shape[:] = [_big(rng) for _ in range(rng.randint(0, 4))]
            elif what == "dtype":
                t.dtype = rng.choice(["float64", "int8", "object", "", "bfloat16"])
            elif what == "offset":
                t.offset = _big(rng)
            elif what == "nbytes":
                t.nbytes = _big(rng)
            elif what == "name":
                t.name = rng.choice(["embed", "norm", "x", ""])
    return pb.WeightMessage(header=header).SerializeToString()


def _chunk_fields(raw: bytes) -> list:
    c = pb.WeightMessage.FromString(raw).chunk
    return [wire.varint(1 << 3) + wire.varint(c.version),
            wire.varint(2 << 3) + wire.varint(c.index),
            wire.varint(3 << 3) + wire.varint(c.offset),
            wire.varint(4 << 3 | 5) + c.crc32.to_bytes(4, "little"),
            wire.len_field(5, len(c.data)) + c.data]


def hostile_stream(rng: random.Random) -> list:
    """A real version's frames after 1-3 hostile edits: bytes mutated, header fields
    edited, frames dropped/duplicated/swapped, garbage frames inserted, a chunk field sent
    with another wire type, or a chunk's fields in another (valid) order."""
    frames = list(FRAMES)
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["bytes", "header", "header", "drop", "dup", "swap", "garbage",
                         "wire_type", "reorder_fields"])
        if not frames:
            frames.append(rng.randbytes(rng.randint(0, 64)))
            continue
        i = rng.randrange(len(frames))
        if op == "bytes":
            frames[i] = mutate(frames[i], rng)
        elif op == "header":
            try:
                frames[0] = edit_header(frames[0], rng)
            except Exception:  # noqa: BLE001 - not a header any more: keep it as it is
                pass
        elif op == "drop":
            del frames[i]
        elif op == "dup":
            frames.insert(i, frames[i])
        elif op == "swap":
            j = rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "garbage":
            frames.insert(i, rng.randbytes(rng.randint(0, 64)))
        elif op in ("wire_type", "reorder_fields") and 0 < i < len(FRAMES) - 1:
            fields = _chunk_fields(FRAMES[i])
            if op == "wire_type":  # one field with another wire type
                k = rng.randrange(5)
                fields[k] = rng.choice([wire.varint((k + 1) << 3 | 0) + wire.varint(7),
                                        wire.varint((k + 1) << 3 | 1) + bytes(8),
                                        wire.varint((k + 1) << 3 | 5) + bytes(4),
                                        wire.len_field(k + 1, 3) + b"abc"])
            else:  # a valid encoding in another field order: must still be accepted
                rng.shuffle(fields)
            body = b"".join(fields)
            frames[i] = wire.len_field(2, len(body)) + body
    return frames


@settings(FUZZ, max_examples=3700)
@given(SEEDS, st.booleans())
@example(-1, False)  # a header claiming 900 GiB
@example(-1, True)
@example(-2, False)  # a chunk's data field as a varint
@example(-3, True)  # the unmodified version: completes, bit-exact
def test_fuzz_weight_frames(seed, expect_shapes):
    COUNTS["weight_streams"] += 1
    frames = {-1: _huge_header, -2: _varint_data, -3: lambda: list(FRAMES)}.get(
        seed, lambda: hostile_stream(random.Random(seed)))()
    reader = weights._StreamReader(1 << 20, weights._BufferPool(), CRC_POOL,
                                   EXPECTED if expect_shapes else None)
    for raw in frames:
        COUNTS["weight_frames"] += 1
        try:
            done = reader.feed(raw)
        except weights._CorruptVersion:
            COUNTS["weight_versions_refused"] += 1
            return  # the subscriber discards the version and reconnects
        if done is None:
            continue
        header, message = done
        params = message.tensors or {}  # a version sent as a directory carries no tensors
        COUNTS["weight_versions_completed"] += 1
        if expect_shapes:
            assert {k: v.shape for k, v in params.items()} == EXPECTED or params == {}
        specs = {t.name: t for t in header.tensors}
        for k, v in params.items():  # what the header said, and views of one buffer
            assert v.shape == tuple(specs[k].shape) and v.nbytes == specs[k].nbytes
        if header.has_crc32 and params:  # crc-verified: exactly the published payload
            for k, v in params.items():  # (a header is structure: trusted as sent)
                off = specs[k].offset
                assert v.tobytes() == PAYLOAD[off:off + v.nbytes], k
            COUNTS["weight_versions_exact"] += 1


def test_weight_subscriber_survives_hostile_streams_over_grpc(report):
    """Hostile streams (the two findings, then 38 seeded `hostile_stream`s) from a real gRPC
    server, one per connection, then a good version: the thread lives through all of them
    and applies it."""
    scripts = [_huge_header(), _varint_data()] + [hostile_stream(random.Random(k))
                                                  for k in range(38)]
    good = list(weights._Version(WeightVersion("full").carrying(6, tensors=PARAMS), "pub", 64,
                                         CRC_POOL).frames())
    applied = []
    with ScriptedPublisher(scripts + [good], hold_open_s=0.0) as pub:
        sub = WeightSubscriber(pub.address, lambda v, p, pv: applied.append(v),
                               retry=RetryPolicy(initial_s=0.001, max_s=0.01),
                               expected_shapes=EXPECTED)
        try:
            assert sub.wait_for_version(6, 60), sub.health()
            health = sub.health()
        finally:
            sub.close()
    assert health["alive"] and health["thread_restarts"] == 0
    assert applied[-1] == 6 and set(applied) <= {5, 6}  # a flip may leave a version intact
    assert pub.calls >= len(scripts) + 1
    report(f"[fuzz] weight stream: {COUNTS['weight_streams']} hostile streams "
           f"({COUNTS['weight_frames']} frames) through the reader: "
           f"{COUNTS['weight_versions_refused']} refused as corrupt, "
           f"{COUNTS['weight_versions_completed']} completed "
           f"({COUNTS['weight_versions_exact']} crc-verified, bit-exact), 0 other errors; "
           f"{len(scripts)} hostile streams over gRPC to one subscriber: "
           f"{health['versions_discarded']} versions discarded, {health['errors']} errors "
           f"recorded, thread alive, then version 6 applied")
    total = COUNTS["queue_cases"] + COUNTS["weight_streams"] + len(scripts)
    report(f"[fuzz] total generated cases in test_fuzz_transport.py: {total}")
