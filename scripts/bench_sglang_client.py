"""Benchmark of the SGLang client: overhead per request, requests/s it sustains, refit time.

    PYTHONPATH=. python scripts/bench_sglang_client.py            # full (~2 min on 2 cores)
    PYTHONPATH=. python scripts/bench_sglang_client.py --quick    # smoke run

Client side: `SGLangEngine` against one test server in `--stub` mode (generation costs
nothing, answers are shaped like SGLang's), so the HTTP client and the engine's bookkeeping
are what is measured:
  roundtrip_ms_p50     one request at a time (n=1, 16 tokens): submit -> Completion;
  requests_per_s       N requests of n=1 in flight up to `--concurrency`; wall clock;
  samples_per_s_n8     the same with groups of n=8 (SGLang's batched form, one HTTP call each);
  client_cpu_ms_per_request / server_cpu_ms_per_request: CPU seconds of each process per
                       request, which says who saturates first (both share this machine).
Refit: a test server with a real JaxEngine holding the tiny (~0.4M) and the ~100M-parameter
model; each version is written with `save_pretrained` into the learner's versioned layout
(`write_s`), then `update_weights(path, v)` pauses the server, loads the directory
(`/update_weights_from_disk`) and continues (`refit_s`, the engine's per-server timing).
Prints one final JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from pipelinerl_jax.rollout.sglang_engine import SGLangEngine  # noqa: E402
from pipelinerl_jax.testing.sglang_process import ServerProcess  # noqa: E402
from pipelinerl_jax.records import GenerationRequest, SamplingParams  # noqa: E402


def req(rid, n=1, seed=None, max_new=16):
    return GenerationRequest(rid, np.arange(1, 33, dtype=np.int32) % 64,
                             SamplingParams(max_new_tokens=max_new, n=n, seed=seed))


def drain(eng, total, timeout=600.0):
    got, deadline = 0, time.monotonic() + timeout
    while got < total:
        got += len(eng.get_completions(timeout=1.0))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{got}/{total} samples")


def client_bench(n_seq: int, n_req: int, n_groups: int, concurrency: int) -> dict:
    server = ServerProcess(["--stub", "--port", "0", "--vocab-size", "64"])
    try:
        with SGLangEngine([server.url], {"concurrency_per_server": concurrency},
                          vocab_size=64, max_seq_len=256) as eng:
            for i in range(20):  # warm the connection pool
                eng.generate([req(f"w{i}")])
            lat = []
            for i in range(n_seq):
                t0 = time.perf_counter()
                eng.generate([req(f"s{i}")])
                lat.append(time.perf_counter() - t0)
            cpu0, srv0, t0 = time.process_time(), server.stats()["cpu_s"], time.perf_counter()
            for i in range(n_req):
                eng.submit(req(f"t{i}", seed=i))
            drain(eng, n_req)
            wall = time.perf_counter() - t0
            cpu, srv = time.process_time() - cpu0, server.stats()["cpu_s"] - srv0
            t1 = time.perf_counter()
            for i in range(n_groups):
                eng.submit(req(f"g{i}", n=8, seed=i))
            drain(eng, 8 * n_groups)
            wall_groups = time.perf_counter() - t1
        return {"roundtrip_ms_p50": 1e3 * statistics.median(lat),
                "roundtrip_ms_p90": 1e3 * float(np.percentile(lat, 90)),
                "requests_per_s": n_req / wall, "samples_per_s_n8": 8 * n_groups / wall_groups,
                "client_cpu_ms_per_request": 1e3 * cpu / n_req,
                "server_cpu_ms_per_request": 1e3 * srv / n_req, "concurrency": concurrency,
                "requests": n_req}
    finally:
        server.kill()


def refit_bench(name: str, model_cfg, repeats: int) -> dict:
    from flax import nnx

    from pipelinerl_jax.models import Decoder, save_pretrained
    from pipelinerl_jax.transport.versioned_dir import write_versioned_dir
    root = tempfile.mkdtemp(prefix=f"sglang_bench_{name}_")
    model = Decoder(model_cfg, nnx.Rngs(0))
    t0 = time.perf_counter()
    first = write_versioned_dir(root, 0, lambda d: save_pretrained(model, d))
    writes = [time.perf_counter() - t0]
    server = ServerProcess(["--model-path", first, "--port", "0", "--weight-version", "0",
                            "--no-warmup", "--engine", json.dumps(
                                {"max_slots": 2, "max_seq_len": 64})])
    try:
        with SGLangEngine([server.url], {}, vocab_size=model_cfg.vocab_size,
                          max_seq_len=64) as eng:
            refits = []
            for v in range(1, repeats + 1):
                t0 = time.perf_counter()
                path = write_versioned_dir(root, v, lambda d: save_pretrained(model, d))
                writes.append(time.perf_counter() - t0)
                eng.update_weights(path, v)
                refits.append(eng.stats()["servers"][0]["last_refit_s"])
        size = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
        return {"params_m": model_cfg.num_params / 1e6, "checkpoint_mb": size / 2**20,
                "write_s": statistics.median(writes), "refit_s": statistics.median(refits),
                "refit_s_max": max(refits), "repeats": repeats}
    finally:
        server.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    from pipelinerl_jax.models import config_100m, tiny_config
    q = args.quick
    out = {"client": client_bench(50 if q else 300, 200 if q else 3000, 20 if q else 200,
                                  args.concurrency)}
    print(json.dumps(out["client"]), file=sys.stderr, flush=True)
    out["refit_tiny"] = refit_bench("tiny", tiny_config(), 2 if q else 5)
    print(json.dumps(out["refit_tiny"]), file=sys.stderr, flush=True)
    if not q:
        out["refit_100m"] = refit_bench("100m", config_100m(), 3)
    out["machine"] = f"{os.cpu_count()} CPU cores, JAX CPU backend"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
