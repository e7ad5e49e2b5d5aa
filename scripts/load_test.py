"""Load test: producers offer ~10x what the learner consumes, for minutes, against the real
RolloutQueue server process; the queue must stay within its bound, push back, and lose nothing
silently (every stored rollout is delivered or dropped with a counted reason).

    PYTHONPATH=. python scripts/load_test.py --minutes=3
    PYTHONPATH=. python scripts/load_test.py --seconds=10        # the short version (tests)

Parties, each its own process on 127.0.0.1 as in a run: the queue server
(`python -m pipelinerl_jax.transport.queue_server`), `--producers` producer processes, and
this process as the learner: every `--step_s` seconds it takes one batch of `--batch_groups`
whole groups, announces version+1 (so groups sampled long ago become stale and are dropped,
counted, under `--max_lag`) and acknowledges it. Producers pace themselves at
`--overload` x the learner's rate in total; a refused put (RESOURCE_EXHAUSTED) is retried
with backoff, which is the backpressure. Every `--abandon_every`-th group a producer sends
only its first half and never the rest (a sampler crashing mid-group): the queue must expire
it (counted) and never deliver it. Every second the queue's stats and its resident memory
(VmRSS) are sampled. At the end producers stop, the learner drains the queue, and the books
are balanced:

    rollouts stored (server) == delivered + dropped by reason (stale, incomplete_timeout, ...)
    rollouts stored (producers' acknowledged puts) == rollouts stored (server)

The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelinerl_jax import records  # noqa: E402
from pipelinerl_jax.transport.queue_client import QueueUnavailable, RolloutQueueClient  # noqa: E402
from pipelinerl_jax.transport.retry import RetryPolicy  # noqa: E402

CTX = mp.get_context("spawn")


def make_group(gid: str, size: int, completion: int, version: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [records.Rollout(
        prompt_ids=rng.integers(0, 1000, 32).astype(np.int32),
        completion_ids=rng.integers(0, 1000, completion).astype(np.int32),
        logp_behaviour=-rng.random(completion).astype(np.float32),
        version=np.full(completion, version, np.int32),
        kv_version=np.full(completion, version, np.int32), reward=float(i % 2),
        advantage=0.5, group_id=gid, group_size=size, task_id="load", finish_reason="stop",
        start_version=version, engine_id="load", submit_time=0.0, start_time=0.0,
        finish_time=0.0, metrics={"member": float(i)}) for i in range(size)]


def producer_main(address: str, index: int, rate: float, args: dict, stop, out_q) -> None:
    """Puts groups at `rate` groups/s (when the queue lets it) until `stop` is set."""
    client = RolloutQueueClient(address, hold_s=0.05,
                                retry=RetryPolicy(initial_s=0.005, max_s=0.2))
    client.wait_ready(30)
    counts = collections.Counter()
    version, seen_at, n = 0, 0.0, 0
    next_t = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now < next_t:
            time.sleep(min(next_t - now, 0.05))
            continue
        next_t += 1.0 / rate
        if now - seen_at > 0.5:  # sample with the learner's current version, as an engine
            version, seen_at = max(0, int(client.stats()["learner_version"])), now
        group = make_group(f"p{index}-{n}", args["group_size"], args["completion"], version, n)
        counts["groups_offered"] += 1
        try:
            if args["abandon_every"] and n % args["abandon_every"] == args["abandon_every"] - 1:
                half = group[:len(group) // 2]
                client.put(half, timeout_s=30)  # ... and the rest never comes
                counts["groups_abandoned"] += 1
                counts["rollouts_stored"] += len(half)
            else:
                client.put_group(group, timeout_s=30)  # retries backpressure for up to 30 s
                counts["groups_stored"] += 1
                counts["rollouts_stored"] += len(group)
        except QueueUnavailable:
            counts["groups_given_up"] += 1  # counted: offered but never stored
        n += 1
    out_q.put((index, dict(counts), dict(client.retry_counts)))
    client.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--overload", type=float, default=10.0, help="offered / consumed rate")
    p.add_argument("--batch_groups", type=int, default=8)
    p.add_argument("--step_s", type=float, default=0.25, help="learner step period")
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--completion", type=int, default=512, help="tokens per completion")
    p.add_argument("--capacity_rollouts", type=int, default=256)
    p.add_argument("--capacity_bytes", type=int, default=64 << 20)
    p.add_argument("--max_lag", type=int, default=4)
    p.add_argument("--abandon_every", type=int, default=50)
    p.add_argument("--incomplete_group_timeout_s", type=float, default=2.0)
    p.add_argument("--fill_first_s", type=float, default=0.0,
                   help="before the timed phase, wait (at most this long) until the queue has "
                        "refused a put as full: producers that start slowly (a loaded machine) "
                        "still meet backpressure within a short run")
    args = p.parse_args(argv)
    duration = args.seconds if args.seconds is not None else 60.0 * (args.minutes or 3.0)

    server = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl_jax.transport.queue_server", "--port", "0",
         "--capacity_rollouts", str(args.capacity_rollouts),
         "--capacity_bytes", str(args.capacity_bytes), "--max_lag", str(args.max_lag),
         "--incomplete_group_timeout_s", str(args.incomplete_group_timeout_s),
         "--max_hold_s", "0.05"],
        stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
    address = server.stdout.readline().split()[-1]
    learner = RolloutQueueClient(address)
    learner.wait_ready(30)
    learner.set_version(0)
    rss_start = rss_mb(server.pid)

    consume_rate = args.batch_groups / args.step_s  # groups/s
    stop, out_q = CTX.Event(), CTX.Queue()
    producers = [CTX.Process(target=producer_main, daemon=True, args=(
        address, i, args.overload * consume_rate / args.producers,
        dict(group_size=args.group_size, completion=args.completion,
             abandon_every=args.abandon_every), stop, out_q)) for i in range(args.producers)]
    for pr in producers:
        pr.start()

    samples, rss = [], []
    done = threading.Event()

    def monitor():
        while not done.wait(1.0):
            s = learner.stats()
            samples.append({k: s[k] for k in ("held_rollouts", "held_bytes", "ready_groups",
                                              "pending_groups", "put_refused_full")})
            rss.append(rss_mb(server.pid))
    threading.Thread(target=monitor, daemon=True).start()

    version = delivered_rollouts = delivered_groups = partial = duplicates = 0
    seen = set()

    def consume(timeout_s: float, num_groups: int = args.batch_groups) -> bool:
        nonlocal version, delivered_rollouts, delivered_groups, partial, duplicates
        batch = learner.get_batch(num_groups, timeout_s, learner_version=version)
        if batch is None:
            return False
        members = collections.Counter(r.group_id for r in batch.rollouts)
        for r in batch.rollouts:
            key = (r.group_id, int(r.metrics["member"]))
            duplicates += key in seen
            seen.add(key)
            partial += members[r.group_id] != r.group_size
        delivered_rollouts += len(batch.rollouts)
        delivered_groups += len(members)
        learner.ack([batch.batch_id])
        version += 1
        return True

    fill_deadline = time.monotonic() + args.fill_first_s
    while args.fill_first_s and time.monotonic() < fill_deadline and \
            learner.stats()["put_refused_full"] == 0:
        time.sleep(0.1)

    t0 = time.monotonic()
    next_step = t0
    while time.monotonic() - t0 < duration:
        time.sleep(max(0.0, next_step - time.monotonic()))
        next_step += args.step_s
        consume(timeout_s=args.step_s)
    steady_s = time.monotonic() - t0
    steady_groups = delivered_groups

    stop.set()  # producers finish the put in hand, then report
    results = []
    deadline = time.monotonic() + 60
    while len(results) < len(producers) and time.monotonic() < deadline:
        consume(timeout_s=0.2)  # keep draining so their last puts find room
        while not out_q.empty():
            results.append(out_q.get())
    for pr in producers:
        pr.join(10)
    time.sleep(args.incomplete_group_timeout_s + 0.5)  # let abandoned groups expire
    while consume(timeout_s=0.5, num_groups=1):  # drain: whatever is left is whole groups
        pass
    final = learner.stats()
    done.set()
    rss_end = rss_mb(server.pid)
    server.terminate()
    server.wait(15)

    counts, retries = collections.Counter(), collections.Counter()
    for _, c, r in results:
        counts.update(c)
        retries.update(r)
    dropped = dict(final["dropped_rollouts"])
    attempts = counts["groups_offered"] + sum(retries.values())
    out = {
        "duration_s": round(steady_s, 1), "producers": args.producers,
        "consumed_groups_per_s": round(steady_groups / steady_s, 1),
        "target_offered_groups_per_s": round(args.overload * consume_rate, 1),
        # what producers managed while backpressure held them (refused attempts included)
        "put_attempts_per_s": round(attempts / steady_s, 1),
        "stored_over_consumed": round(counts["groups_stored"] / max(steady_groups, 1), 2),
        "capacity_rollouts": args.capacity_rollouts, "capacity_bytes": args.capacity_bytes,
        "max_held_rollouts": final["max_held_rollouts"],
        "max_held_bytes": final["max_held_bytes"],
        "queue_rss_mb_start": round(rss_start, 1), "queue_rss_mb_max": round(max(rss), 1),
        "queue_rss_mb_end": round(rss_end, 1),
        "put_refused_full": final["put_refused_full"],
        "producer_retries": dict(retries),
        "groups_offered": counts["groups_offered"], "groups_stored": counts["groups_stored"],
        "groups_abandoned_half_put": counts["groups_abandoned"],
        "groups_given_up": counts["groups_given_up"],
        "rollouts_stored_producers": counts["rollouts_stored"],
        "rollouts_stored_server": final["put_rollouts"],
        "rollouts_delivered": delivered_rollouts, "groups_delivered": delivered_groups,
        "dropped_rollouts": dropped, "held_rollouts_end": final["held_rollouts"],
        "partial_groups_delivered": partial, "duplicate_rollouts_delivered": duplicates,
        # stored = delivered + dropped (by reason) once nothing is held: the books balance
        "lost_rollouts": final["put_rollouts"] - delivered_rollouts - sum(dropped.values())
        - final["held_rollouts"],
        "producer_server_mismatch": counts["rollouts_stored"] - final["put_rollouts"],
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
