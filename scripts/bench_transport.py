"""Transport benchmark: RolloutQueue throughput/latency and weight-sync time vs raw TCP.

    PYTHONPATH=. python scripts/bench_transport.py [--quick]

Every party is a separate process on 127.0.0.1, as in a one-machine run: the queue server is
`python -m pipelinerl_jax.transport.queue_server`, producers are spawned processes, the
consumer (learner side) is this process; the weight publisher is a spawned process and the
subscriber lives here. The physical limit is the loopback bandwidth of a plain TCP socket
measured in the same run (one sender process, `recv_into` a preallocated buffer).
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelinerl_jax import records  # noqa: E402
from pipelinerl_jax.transport.queue_client import RolloutQueueClient  # noqa: E402
from pipelinerl_jax.transport.weight_version import WeightVersion  # noqa: E402
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber  # noqa: E402

FULL = WeightVersion("full")

CTX = mp.get_context("spawn")
PROMPT_TOKENS = 128
GROUP_SIZE = 8


# ------------------------------------------------------------------------------ TCP limit

def _tcp_sink(port_q, total: int, chunk: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf, got = memoryview(bytearray(chunk)), 0
    while got < total:
        got += conn.recv_into(buf)
    conn.sendall(b"k")
    conn.close()


def tcp_bandwidth(total: int, chunk: int = 4 << 20) -> float:
    """Bytes/s of one TCP stream over loopback between two processes (best of 2)."""
    best = 0.0
    for _ in range(2):
        q = CTX.Queue()
        p = CTX.Process(target=_tcp_sink, args=(q, total, chunk))
        p.start()
        sock = socket.create_connection(("127.0.0.1", q.get()))
        data, sent = memoryview(bytearray(chunk)), 0
        t0 = time.perf_counter()
        while sent < total:
            sock.sendall(data)
            sent += chunk
        sock.recv(1)
        best = max(best, total / (time.perf_counter() - t0))
        sock.close()
        p.join()
    return best


def _grpc_source(port_q, total: int, chunk: int) -> None:
    import grpc
    from concurrent import futures
    payload = [bytes(chunk) for _ in range(8)]

    def stream(request, context):
        for i in range(total // chunk):
            yield payload[i % 8]

    opts = [("grpc.max_send_message_length", chunk + 1024)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=opts, handlers=[
        grpc.method_handlers_generic_handler("bench", {"s": grpc.unary_stream_rpc_method_handler(
            stream, lambda b: b, lambda b: b)})])
    port_q.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination(600)


def grpc_stream_bandwidth(total: int, chunk: int) -> float:
    """Bytes/s of a bare gRPC server stream of prebuilt `chunk`-byte messages between two
    processes: the ceiling for weight sync over gRPC in Python (best of 2)."""
    import grpc
    q = CTX.Queue()
    p = CTX.Process(target=_grpc_source, args=(q, total, chunk), daemon=True)
    p.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{q.get()}", options=[
        ("grpc.max_receive_message_length", chunk + 1024)])
    call = channel.unary_stream("/bench/s", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    best = 0.0
    for _ in range(2):
        t0, n = time.perf_counter(), 0
        for msg in call(b""):
            n += len(msg)
        best = max(best, n / (time.perf_counter() - t0))
    p.kill()
    return best


# ------------------------------------------------------------------------------ queue

def _rollouts(group_id: str, tokens: int) -> list:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32000, PROMPT_TOKENS, dtype=np.int32)
    comp = rng.integers(0, 32000, tokens, dtype=np.int32)
    logp = -rng.random(tokens, dtype=np.float32)
    ver = np.zeros(tokens, np.int32)
    return [records.Rollout(prompt, comp, logp, ver, ver, 1.0, 0.0, group_id, GROUP_SIZE,
                          metrics={"t_put": 0.0}) for _ in range(GROUP_SIZE)]


def _producer(address: str, name: str, groups: int, tokens: int, start, out_q) -> None:
    client = RolloutQueueClient(address)
    client.wait_ready(30)
    group = _rollouts("", tokens)
    out_q.put("ready")
    start.wait()
    for g in range(groups):
        for r in group:
            r.group_id = f"{name}-{g}"
            r.metrics["t_put"] = time.monotonic()
        client.put_group(group)
    out_q.put(dict(client.retry_counts))
    client.close()


def queue_throughput(address: str, producers: int, tokens: int, groups: int) -> dict:
    """Producers put `groups` groups in total; the consumer takes 4-group batches and acks."""
    consumer = RolloutQueueClient(address)
    consumer.new_session()
    start, out_q = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_producer, args=(address, f"{tokens}-{producers}-p{i}",
                                                 groups // producers,
                                                 tokens, start, out_q))
             for i in range(producers)]
    for p in procs:
        p.start()
    total = (groups // producers) * producers * GROUP_SIZE
    for _ in procs:  # time the transfer, not the producers' start-up
        assert out_q.get(timeout=120) == "ready"
    start.set()
    t0, got, nbytes = time.perf_counter(), 0, 0
    while got < total:
        batch = consumer.get_batch(min(4, (total - got) // GROUP_SIZE), timeout_s=60.0,
                                   learner_version=0)
        if batch is None:
            raise RuntimeError(f"queue stalled at {got}/{total} rollouts")
        consumer.ack([batch.batch_id])
        got += len(batch.rollouts)
        nbytes += sum(4 * (r.prompt_ids.size + 4 * r.completion_ids.size)
                      for r in batch.rollouts)
    dt = time.perf_counter() - t0
    retries = [out_q.get() for _ in procs]
    for p in procs:
        p.join()
    consumer.close()
    return {"rollouts_per_s": round(total / dt, 1), "MB_per_s": round(nbytes / dt / 1e6, 1),
            "retries": sum(sum(r.values()) for r in retries)}


def queue_latency(address: str, n: int, tokens: int) -> dict:
    """Put→get latency at light load: one group in flight, the consumer already waiting."""
    consumer, producer = RolloutQueueClient(address), RolloutQueueClient(address)
    consumer.new_session()
    group = _rollouts("", tokens)
    lat = []
    for i in range(n):
        got = {}

        def take():
            batch = consumer.get_batch(1, timeout_s=30.0, learner_version=0)
            got["t"] = time.monotonic()
            consumer.ack([batch.batch_id])

        t = threading.Thread(target=take)
        t.start()
        time.sleep(0.002)  # the consumer is waiting before the put
        for r in group:
            r.group_id = f"lat-{i}"
        t_put = time.monotonic()
        producer.put_group(group)
        t.join()
        lat.append(got["t"] - t_put)
    consumer.close()
    producer.close()
    return {"p50_ms": round(1e3 * float(np.percentile(lat, 50)), 2),
            "p99_ms": round(1e3 * float(np.percentile(lat, 99)), 2)}


# ------------------------------------------------------------------------------ weights

def transformer_params(d: int, ff: int, layers: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    shapes = {"embed/embedding": (vocab, d), "final_norm/scale": (d,)}
    for i in range(layers):
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"layers/{i}/attn/{n}/kernel"] = (d, d)
        shapes[f"layers/{i}/mlp/gate_proj/kernel"] = (d, ff)
        shapes[f"layers/{i}/mlp/up_proj/kernel"] = (d, ff)
        shapes[f"layers/{i}/mlp/down_proj/kernel"] = (ff, d)
        shapes[f"layers/{i}/attn_norm/scale"] = (d,)
        shapes[f"layers/{i}/mlp_norm/scale"] = (d,)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


MODELS = {"0.4M": dict(d=128, ff=344, layers=2, vocab=512),
          "100M": dict(d=768, ff=2048, layers=12, vocab=20000)}


def _publisher(model: str, chunk_bytes: int, checksum: bool, conn) -> None:
    params = transformer_params(**MODELS[model])
    pub = WeightPublisher(chunk_bytes=chunk_bytes, checksum=checksum)
    conn.send((pub.address, sum(a.nbytes for a in params.values()),
               sum(a.size for a in params.values())))
    while True:
        version = conn.recv()
        if version is None:
            break
        t = time.monotonic()
        pub.publish(FULL.carrying(version, tensors=params))  # same arrays, new version
        conn.send(t)
    pub.stop()


def weight_sync(model: str, versions: int, chunk_bytes: int, checksum: bool = True) -> dict:
    """Seconds from `publish(v)` in the publisher process to `on_weights(v)` returning in
    this one (median over versions after the first, which pays for fresh pages)."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_publisher, args=(model, chunk_bytes, checksum, child))
    proc.start()
    address, nbytes, nparams = parent.recv()
    applied = {}
    sub = WeightSubscriber(address, lambda m: applied.__setitem__(m.version, time.monotonic()),
                           max_message_bytes=chunk_bytes + (1 << 20))
    times = []
    for v in range(versions):
        parent.send(v)
        t_pub = parent.recv()
        if not sub.wait_for_version(v, timeout=300):
            raise RuntimeError(f"version {v} never arrived: {sub.last_error}")
        times.append(applied[v] - t_pub)
    parent.send(None)
    proc.join()
    sub.close()
    warm = times[1:] if len(times) > 1 else times  # the first version pays fresh pages
    t = statistics.median(warm)
    return {"params": nparams, "MB": round(nbytes / 1e6, 1), "seconds": round(t, 4),
            "first_s": round(times[0], 4), "GB_per_s": round(nbytes / t / 1e9, 3)}


# ------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    ap.add_argument("--chunk_bytes", type=int, default=4 << 20)
    args = ap.parse_args()
    q = 4 if args.quick else 1
    result = {"machine": f"{os.cpu_count()} CPU cores, loopback", "quick": args.quick}

    tcp = tcp_bandwidth((1 << 30) // q)
    result["tcp_loopback_GB_per_s"] = round(tcp / 1e9, 3)

    server = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl_jax.transport.queue_server", "--port", "0",
         "--capacity_rollouts", "1024"], stdout=subprocess.PIPE, text=True)
    address = server.stdout.readline().split()[-1]
    try:
        for tokens in (512, 4096):
            for producers in (1, 4):
                groups = (200 if tokens == 512 else 64) // q
                groups = max(producers, groups // producers * producers)
                r = queue_throughput(address, producers, tokens, groups)
                result[f"queue_{tokens}tok_{producers}prod"] = r
                print(f"queue {tokens} tokens, {producers} producers: {r}", flush=True)
        result["queue_latency_512tok"] = queue_latency(address, 200 // q, 512)
        print("latency", result["queue_latency_512tok"], flush=True)
    finally:
        server.terminate()
        server.wait(10)

    # The machine may be shared: take the best socket figure seen, measured again right
    # before the weight runs, as the physical limit.
    tcp = max(tcp, tcp_bandwidth((1 << 30) // q))
    result["tcp_loopback_GB_per_s"] = round(tcp / 1e9, 3)
    for model, versions in (("0.4M", 10), ("100M", 4 if not args.quick else 2)):
        r = weight_sync(model, versions, args.chunk_bytes)
        r["fraction_of_tcp"] = round(r["GB_per_s"] * 1e9 / tcp, 3)
        result[f"weights_{model}"] = r
        print(f"weights {model}: {r}", flush=True)
    r = weight_sync("100M", 4 if not args.quick else 2, args.chunk_bytes, checksum=False)
    r["fraction_of_tcp"] = round(r["GB_per_s"] * 1e9 / tcp, 3)
    result["weights_100M_no_checksum"] = r
    print(f"weights 100M without crc32: {r}", flush=True)
    raw = grpc_stream_bandwidth((400 << 20) // q, args.chunk_bytes)
    result["grpc_raw_stream_GB_per_s"] = round(raw / 1e9, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
