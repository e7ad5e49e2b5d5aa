"""Soak benchmark (not a test): a token-authenticated RolloutQueue under a hostile but
authorised producer mix for minutes; the queue server's resident memory must stay within its
configured capacity plus a stated constant, and nothing accepted may be lost.

    PYTHONPATH=. python scripts/soak_queue.py --minutes=10
    PYTHONPATH=. python scripts/soak_queue.py --seconds=20        # a smoke run

Parties, each its own process on 127.0.0.1: the queue server (`python -m
pipelinerl_jax.transport.queue_server --token_file ...`), `--producers` producer processes
holding the token, and this process as the learner. Each producer picks, put after put, one
of (weights in `MIX`):
  group          a valid group of 4 (64-1024 tokens each), through the client (backpressure
                 retried)
  half_group     its first half only, never the rest (expires, counted)
  near_limit     a one-rollout group as large as a batch can carry (max_message_bytes minus
                 framing, minus a little)
  undeliverable  a raw put of a rollout a batch could never carry (exactly the limit):
                 must be refused INVALID_ARGUMENT
  unknown_fields a valid group plus ~1 MiB of unknown fields: stored, the unknown dropped
  max_ids        a valid group with 128-character request and producer ids (fills the
                 remembered-id tables with the largest entries allowed)
  long_id        a 1 MB request_id: must be refused INVALID_ARGUMENT
  duplicate      a valid group put twice with one request_id: the second is a duplicate
  invalid        a NaN log-prob: refused naming the field
  garbage        random bytes: refused
  oversized      a request over max_message_bytes: gRPC's RESOURCE_EXHAUSTED (not retried)
  noise          GetStats with a 128-character producer id, Ack of made-up batch ids
The learner takes a batch of `--batch_groups` groups every `--step_s` seconds, announces
version + 1, acknowledges every `--ack_every` batches (as after a checkpoint), and every
`--restart_every` batches starts a new consumer session without acknowledging what it holds
(a learner restart: those batches are redelivered). Every second the server's VmRSS and
stats are sampled. At the end the queue is drained and the books balanced (rollouts stored =
delivered once + dropped by reason + held).

Memory bound checked (`within_bound`): RSS <= RSS at start + capacity_bytes + the
remembered-id tables (4 x `queue_core.REMEMBER_BYTES`) + in-flight requests (each concurrent
call can hold its raw bytes, the parsed message and the kept copy: 3 x max_message_bytes per
producer and the learner). The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from load_test import make_group, rss_mb  # noqa: E402
from pipelinerl_jax.transport import rollout_pb2 as pb  # noqa: E402
from pipelinerl_jax.transport.codec import rollout_to_pb  # noqa: E402
from pipelinerl_jax.transport.queue_client import QueueUnavailable, RolloutQueueClient, TransportError  # noqa: E402
from pipelinerl_jax.transport.retry import RetryPolicy  # noqa: E402
from pipelinerl_jax.transport.queue_core import REMEMBER_BYTES, max_rollout_bytes  # noqa: E402
from pipelinerl_jax.transport.queue_server import SERVICE  # noqa: E402
from pipelinerl_jax.transport.wire import len_field  # noqa: E402

CTX = mp.get_context("spawn")
MIB = 1 << 20
MIX = {"group": 40, "half_group": 5, "near_limit": 3, "undeliverable": 3,
       "unknown_fields": 6, "max_ids": 8, "long_id": 5, "duplicate": 6, "invalid": 6,
       "garbage": 6, "oversized": 2, "noise": 10}


def _sized_rollout(gid: str, nbytes: int, version: int) -> pb.Rollout:
    """A valid wire rollout of about `nbytes` serialized (16 bytes per completion token)."""
    return rollout_to_pb(make_group(gid, 1, max(1, (nbytes - 400) // 16), version, 0)[0])


def producer_main(address: str, token: str, index: int, limit: int, seed: int,
                  stop, out_q) -> None:
    rng = random.Random(seed)
    md = (("authorization", f"Bearer {token}"),)
    client = RolloutQueueClient(address, token=token, hold_s=0.05, max_message_bytes=limit,
                                retry=RetryPolicy(initial_s=0.005, max_s=0.2))
    client.producer_id = f"soak{index}"
    client.wait_ready(30)
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", 4 * limit),
        ("grpc.max_receive_message_length", 4 * limit)])
    raw_put = channel.unary_unary(f"/{SERVICE}/Put", request_serializer=lambda b: b,
                                  response_deserializer=pb.PutResponse.FromString)
    stats = channel.unary_unary(f"/{SERVICE}/GetStats", request_serializer=lambda b: b,
                                response_deserializer=pb.QueueStats.FromString)
    ack = channel.unary_unary(f"/{SERVICE}/Ack", request_serializer=lambda b: b,
                              response_deserializer=pb.AckResponse.FromString)
    counts = collections.Counter()
    actions, weights = zip(*MIX.items())
    version, seen_at, n = 0, 0.0, 0

    def put(raw: bytes, stored: int, what: str) -> None:
        for _ in range(50):  # backpressure (marked) is retried; anything else is the answer
            try:
                resp = raw_put(raw, timeout=30, metadata=md)
                counts[f"{what}:OK{':duplicate' if resp.duplicate else ''}"] += 1
                counts["rollouts_stored"] += resp.accepted
                return
            except grpc.RpcError as e:
                marked = any(k == "pipelinerl-backpressure" for k, _ in
                             (e.trailing_metadata() or ()))
                if not marked:
                    counts[f"{what}:{e.code().name}"] += 1
                    return
                time.sleep(0.05)
        counts[f"{what}:gave_up"] += 1

    while not stop.is_set():
        now = time.monotonic()
        if now - seen_at > 0.5:
            version, seen_at = max(0, int(client.stats()["learner_version"])), now
        action = rng.choices(actions, weights)[0]
        gid = f"p{index}-{n}"
        n += 1
        counts[f"offered:{action}"] += 1
        try:
            if action == "group":
                group = make_group(gid, 4, rng.randint(64, 1024), version, n)
                client.put_group(group, timeout_s=30)
                counts["group:OK"] += 1
                counts["rollouts_stored"] += 4
            elif action == "half_group":
                client.put(make_group(gid, 4, 256, version, n)[:2], timeout_s=30)
                counts["half_group:OK"] += 1
                counts["rollouts_stored"] += 2
            elif action == "near_limit":
                m = _sized_rollout(gid, max_rollout_bytes(limit) - 64, version)
                put(pb.PutRequest(rollouts=[m], request_id=gid).SerializeToString(), 1,
                    action)
            elif action == "undeliverable":
                m = _sized_rollout(gid, limit - 64, version)
                put(pb.PutRequest(rollouts=[m]).SerializeToString(), 0, action)
            elif action == "unknown_fields":
                msgs = [rollout_to_pb(r) for r in make_group(gid, 2, 128, version, n)]
                payload = bytes(rng.getrandbits(8) for _ in range(64)) * (MIB // 64)
                raw = pb.PutRequest(rollouts=msgs, request_id=gid).SerializeToString()
                put(raw + len_field(999, len(payload)) + payload, 2, action)
            elif action == "max_ids":
                msgs = [rollout_to_pb(r) for r in make_group(gid, 2, 64, version, n)]
                put(pb.PutRequest(rollouts=msgs, request_id=gid.ljust(128, "r"),
                                  producer_id=f"soak{index}-".ljust(128, "p"))
                    .SerializeToString(), 2, action)
            elif action == "long_id":
                msgs = [rollout_to_pb(r) for r in make_group(gid, 1, 64, version, n)]
                put(pb.PutRequest(rollouts=msgs, request_id="x" * MIB).SerializeToString(), 0,
                    action)
            elif action == "duplicate":
                msgs = [rollout_to_pb(r) for r in make_group(gid, 2, 128, version, n)]
                raw = pb.PutRequest(rollouts=msgs, request_id=gid).SerializeToString()
                put(raw, 2, action)
                put(raw, 0, action)
            elif action == "invalid":
                m = rollout_to_pb(make_group(gid, 1, 64, version, n)[0])
                m.logp_behaviour.data = np.full(64, np.nan, np.float32).tobytes()
                put(pb.PutRequest(rollouts=[m]).SerializeToString(), 0, action)
            elif action == "garbage":
                put(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512))), 0, action)
            elif action == "oversized":
                m = _sized_rollout(gid, limit + 4096, version)
                put(pb.PutRequest(rollouts=[m]).SerializeToString(), 0, action)
            elif action == "noise":
                stats(pb.StatsRequest(producer_id="n" * 128).SerializeToString(), timeout=10,
                      metadata=md)
                ack(pb.AckRequest(batch_ids=[f"made-up-{n}-{k}".ljust(128, "b")
                                             for k in range(8)]).SerializeToString(),
                    timeout=10, metadata=md)
                counts["noise:OK"] += 1
        except QueueUnavailable:
            counts[f"{action}:gave_up"] += 1
        except (TransportError, grpc.RpcError) as e:
            counts[f"{action}:error:{getattr(e, 'code', lambda: '?')}"] += 1
    out_q.put((index, dict(counts)))
    channel.close()
    client.close()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch_groups", type=int, default=4)
    p.add_argument("--step_s", type=float, default=1.0, help="slower than the producers: "
                   "the queue fills to its capacity and stays there")
    p.add_argument("--ack_every", type=int, default=4)
    p.add_argument("--restart_every", type=int, default=200)
    p.add_argument("--capacity_rollouts", type=int, default=1024)
    p.add_argument("--capacity_bytes", type=int, default=64 * MIB)
    p.add_argument("--max_message_bytes", type=int, default=4 * MIB)
    p.add_argument("--max_lag", type=int, default=None, help="none: nothing is dropped as "
                   "stale, so the queue stays full")
    p.add_argument("--incomplete_group_timeout_s", type=float, default=3.0)
    args = p.parse_args(argv)
    duration = args.seconds if args.seconds is not None else 60.0 * args.minutes
    limit = args.max_message_bytes

    tmp = tempfile.mkdtemp(prefix="soak_queue_")
    token = "soak-" + os.urandom(8).hex()
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write(token + "\n")
    server = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl_jax.transport.queue_server", "--port", "0",
         "--token_file", token_file, "--capacity_rollouts", str(args.capacity_rollouts),
         "--capacity_bytes", str(args.capacity_bytes),
         *(["--max_lag", str(args.max_lag)] if args.max_lag is not None else []),
         "--max_message_bytes", str(limit), "--max_completion_tokens", str(limit // 8),
         "--incomplete_group_timeout_s", str(args.incomplete_group_timeout_s),
         "--max_hold_s", "0.05"], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT))
    address = server.stdout.readline().split()[-1]
    learner = RolloutQueueClient(address, token=token, max_message_bytes=limit)
    learner.wait_ready(30)
    learner.set_version(0)
    rss_start = rss_mb(server.pid)

    stop, out_q = CTX.Event(), CTX.Queue()
    producers = [CTX.Process(target=producer_main, daemon=True, args=(
        address, token, i, limit, 1000 + i, stop, out_q)) for i in range(args.producers)]
    for pr in producers:
        pr.start()

    rss, held = [], []
    done = threading.Event()

    def monitor():
        while not done.wait(1.0):
            rss.append(rss_mb(server.pid))
            held.append(learner.stats()["held_bytes"])
    threading.Thread(target=monitor, daemon=True).start()

    books = collections.Counter()
    seen_batches, pending = set(), []
    version = 0

    def consume(timeout_s: float, num_groups: int, ack_now: bool = False) -> bool:
        nonlocal version
        batch = learner.get_batch(num_groups, timeout_s, learner_version=version)
        if batch is None:
            return False
        members = collections.Counter(r.group_id for r in batch.rollouts)
        books["partial_groups"] += sum(members[r.group_id] != r.group_size
                                       for r in batch.rollouts)
        books["bad_rows"] += sum(not (np.isfinite(r.logp_behaviour).all() and
                                      (r.logp_behaviour <= 0).all()) for r in batch.rollouts)
        if batch.batch_id in seen_batches:
            books["redelivered_batches"] += 1
        else:
            seen_batches.add(batch.batch_id)
            books["rollouts_delivered"] += len(batch.rollouts)
            books["groups_delivered"] += len(members)
            books["batches"] += 1
        pending.append(batch.batch_id)
        version += 1
        if not ack_now and books["restarts"] < books["batches"] // args.restart_every:
            books["restarts"] += 1  # a learner restart before its ack: those batches come back
            pending.clear()
            learner.new_session()
        elif ack_now or len(pending) >= args.ack_every:
            learner.ack(pending)
            pending.clear()
        return True

    t0 = time.monotonic()
    next_step = t0
    while time.monotonic() - t0 < duration:
        time.sleep(max(0.0, next_step - time.monotonic()))
        next_step += args.step_s
        consume(args.step_s, args.batch_groups)
    elapsed = time.monotonic() - t0

    stop.set()
    results, deadline = [], time.monotonic() + 120
    while len(results) < len(producers) and time.monotonic() < deadline:
        consume(0.2, 1)
        while not out_q.empty():
            results.append(out_q.get())
    for pr in producers:
        pr.join(10)
    time.sleep(args.incomplete_group_timeout_s + 1.0)
    while consume(0.5, 1, ack_now=True):
        pass
    if pending:
        learner.ack(pending)
    final = learner.stats()
    done.set()
    rss_end = rss_mb(server.pid)
    server.terminate()
    server.wait(15)

    counts = collections.Counter()
    for _, c in results:
        counts.update(c)
    dropped = dict(final["dropped_rollouts"])
    constant_mb = 4 * REMEMBER_BYTES / MIB + 3 * limit / MIB * (args.producers + 1)
    bound_mb = rss_start + args.capacity_bytes / MIB + constant_mb
    out = {
        "duration_s": round(elapsed, 1), "producers": args.producers, "mix": MIX,
        "capacity_rollouts": args.capacity_rollouts, "capacity_bytes": args.capacity_bytes,
        "max_message_bytes": limit,
        "max_held_bytes": final["max_held_bytes"], "max_held_rollouts": final["max_held_rollouts"],
        "queue_rss_mb_start": round(rss_start, 1), "queue_rss_mb_max": round(max(rss), 1),
        "queue_rss_mb_end": round(rss_end, 1),
        "rss_bound_mb": round(bound_mb, 1), "stated_constant_mb": round(constant_mb, 1),
        "within_bound": max(rss) <= bound_mb,
        "outcomes": dict(sorted(counts.items())),
        "put_requests": final["put_requests"], "put_invalid": final["put_invalid"],
        "put_refused_full": final["put_refused_full"],
        "put_duplicates": final["put_duplicates"],
        "rollouts_stored_server": final["put_rollouts"],
        "rollouts_stored_producers": counts["rollouts_stored"],
        "rollouts_delivered": books["rollouts_delivered"],
        "groups_delivered": books["groups_delivered"], "batches": books["batches"],
        "learner_restarts": books["restarts"],
        "redelivered_batches": books["redelivered_batches"],
        "dropped_rollouts": dropped, "held_rollouts_end": final["held_rollouts"],
        "held_bytes_end": final["held_bytes"], "outstanding_batches_end":
            final["outstanding_batches"],
        "partial_groups_delivered": books["partial_groups"], "bad_rows": books["bad_rows"],
        "lost_rollouts": final["put_rollouts"] - books["rollouts_delivered"]
        - sum(dropped.values()) - final["held_rollouts"],
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
