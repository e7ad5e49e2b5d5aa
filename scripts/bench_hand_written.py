"""Hand-written code against the library that could replace it, each pair timed interleaved
in the same run (so a shared machine's load hits both arms alike). Prints one JSON line.

    PYTHONPATH=. python scripts/bench_hand_written.py [--rounds 5]

- tb_events: `pipelinerl_jax.tb_events` against the `tensorboard` package's EventFileWriter
  (fresh interpreters; CPU seconds to import and write 200 events of 20 scalars and a
  histogram). Skipped, and said so, when `tensorboard` is not installed (not a dependency).
- safetensors: `hf_io.iter_safetensors` against `safetensors.safe_open` (numpy), reading
  192 MiB of float32 and 16 MiB of bfloat16 tensor by tensor (seconds, median).
- http: `rollout.sglang_client.ServerClient` against a urllib3 `PoolManager` with retries,
  keep-alive both, posting a /generate-sized JSON to a stub server in a child process
  (client CPU ms per request, median).
- grpc_retries: what gRPC's service-config retry policy does when asked for 10 attempts
  against a server answering UNAVAILABLE (attempts the server saw, seconds until it gave up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TB_ARM = r'''
import sys, tempfile, time
t0 = time.process_time()
import numpy as np
d = tempfile.mkdtemp()
hist = np.arange(64.0)
if sys.argv[1] == "ours":
    from pipelinerl_jax import tb_events
    w = tb_events.EventFileWriter(d, "x")
    for s in range(200):
        w.write(time.time(), s, [tb_events.scalar_value(f"m/{k}", float(k * s)) for k in range(20)]
                + [tb_events.histogram_value("h", hist)])
else:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    w = EventFileWriter(d, filename_suffix="x")
    for s in range(200):
        values = [summary_pb2.Summary.Value(tag=f"m/{k}", simple_value=float(k * s))
                  for k in range(20)]
        values.append(summary_pb2.Summary.Value(tag="h", histo=summary_pb2.HistogramProto(
            min=0.0, max=63.0, num=64, sum=float(hist.sum()), sum_squares=float((hist ** 2).sum()),
            bucket_limit=hist.tolist(), bucket=[1.0] * 64)))
        w.add_event(event_pb2.Event(wall_time=time.time(), step=s,
                                    summary=summary_pb2.Summary(value=values)))
w.close()
print(time.process_time() - t0)
'''

STUB_SERVER = r'''
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        out = json.dumps({"output_ids": list(range(64)), "meta_info": {"id": "x"}}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out))); self.end_headers()
        self.wfile.write(out)
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
'''


def _median(xs, digits=3):
    return round(float(statistics.median(xs)), digits)


def bench_tb_events(rounds):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return {"skipped": "the tensorboard package is not installed"}
    env = dict(os.environ, PYTHONPATH=ROOT)
    cpu = {"ours": [], "tensorboard": []}
    for _ in range(rounds):
        for arm in cpu:
            out = subprocess.run([sys.executable, "-c", TB_ARM, arm], capture_output=True,
                                 text=True, env=env, check=True).stdout
            cpu[arm].append(float(out.strip().splitlines()[-1]))
    return {f"{arm}_cpu_s": _median(v) for arm, v in cpu.items()}


def bench_safetensors(rounds):
    import ml_dtypes
    from safetensors import safe_open

    from pipelinerl_jax.models.hf_io import iter_safetensors, write_safetensors
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(48)}
    tensors.update({f"b{i}": rng.standard_normal((1024, 512)).astype(ml_dtypes.bfloat16)
                    for i in range(16)})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        write_safetensors(path, tensors)

        def library():
            with safe_open(path, framework="numpy") as f:
                for k in f.keys():
                    yield k, f.get_tensor(k)
        arms = {"ours": lambda: ((k, np.array(v)) for k, v in iter_safetensors(path)),
                "safetensors": library}
        for fn in arms.values():  # both read back exactly what was written
            got = dict(fn())
            assert all(got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes()
                       for k, v in tensors.items())
        secs = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm, fn in arms.items():
                t = time.perf_counter()
                for _, v in fn():
                    v.sum(dtype=np.float32)
                secs[arm].append(time.perf_counter() - t)
    return {f"{arm}_s": _median(v) for arm, v in secs.items()}


def bench_http(rounds, n=400):
    import urllib3

    from pipelinerl_jax.rollout.sglang_client import ServerClient
    srv = subprocess.Popen([sys.executable, "-c", STUB_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(srv.stdout.readline())}"
        ours = ServerClient(url)
        pool = urllib3.PoolManager(maxsize=4, retries=urllib3.Retry(
            3, backoff_factor=0.01, status_forcelist=(502, 503, 504)))
        body = {"input_ids": list(range(128)), "sampling_params": {"max_new_tokens": 64}}
        arms = {"ours": lambda: ours.post("/generate", body),
                "urllib3": lambda: json.loads(pool.request(
                    "POST", url + "/generate", body=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"}).data)}
        assert arms["ours"]() == arms["urllib3"]()
        cpu = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm, fn in arms.items():
                t = time.process_time()
                for _ in range(n):
                    fn()
                cpu[arm].append(1e3 * (time.process_time() - t) / n)
    finally:
        srv.kill()
    return {f"{arm}_client_cpu_ms_per_request": _median(v) for arm, v in cpu.items()}


def bench_grpc_retries(asked=10):
    import grpc
    calls = []

    def handler(request, context):
        calls.append(time.monotonic())
        context.abort(grpc.StatusCode.UNAVAILABLE, "down")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.S", {"M": grpc.unary_unary_rpc_method_handler(handler)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    config = {"methodConfig": [{"name": [{"service": "bench.S"}], "retryPolicy": {
        "maxAttempts": asked, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))])
    t = time.monotonic()
    try:
        channel.unary_unary("/bench.S/M", request_serializer=lambda b: b,
                            response_deserializer=lambda b: b)(b"x", timeout=30)
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    gave_up = time.monotonic() - t
    channel.close()
    server.stop(0)
    return {"asked_attempts": asked, "server_saw": len(calls),
            "gave_up_after_s": round(gave_up, 2), "final_code": code}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    print(json.dumps({"rounds": a.rounds, "tb_events": bench_tb_events(a.rounds),
                      "safetensors": bench_safetensors(a.rounds), "http": bench_http(a.rounds),
                      "grpc_retries": bench_grpc_retries()}), flush=True)


if __name__ == "__main__":
    main()
