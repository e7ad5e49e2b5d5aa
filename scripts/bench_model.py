"""Model throughput: forward and forward+backward tokens/s, and MFU against measured peak.

    python scripts/bench_model.py [--quick]

Measures, in one run: this machine's float32 matmul GFLOP/s (the peak MFU is relative to),
then for the default tiny model and a ~100M-parameter Llama config the tokens/s of a jitted
forward and of a jitted forward+backward (loss = mean token log-prob). MFU = achieved model
FLOP/s / measured matmul FLOP/s, counting 2·params (+ attention) FLOPs per token forward and
3× that for forward+backward. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.models import config_100m, tiny_config, token_logprobs


def _timeit(fn, *args, repeats=5, best=False):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    times.sort()
    return times[0] if best else times[len(times) // 2]


_matmul = jax.jit(lambda x, y: x @ y)  # one jitted function: repeated calls never retrace


def matmul_gflops(n: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
    """The matmul peak on the default device, n x n x n in `dtype`: the best of `repeats` (a
    median of 5 read 124 GFLOP/s on 2026-11-29 where the best of 10 reads ~375 on a quiet
    machine). scripts/bench_real_size.py and bench_pipeline.py measure their peaks with it."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    return 2 * n**3 / _timeit(_matmul, a, b, repeats=repeats, best=True) / 1e9



def bench_model(cfg, batch: int, seq: int, peak_gflops: float, repeats: int) -> dict:
    model = create_model(cfg)
    graphdef, params = nnx.split(model)
    ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, cfg.vocab_size, jnp.int32)

    @jax.jit
    def forward(params, ids):
        return nnx.merge(graphdef, params)(ids)

    def loss(params, ids):
        logits = nnx.merge(graphdef, params)(ids)
        return -jnp.mean(token_logprobs(logits[:, :-1], ids[:, 1:]))

    fwd_bwd = jax.jit(jax.value_and_grad(loss))
    tokens = batch * seq
    t_f = _timeit(forward, params, ids, repeats=repeats)
    t_fb = _timeit(fwd_bwd, params, ids, repeats=repeats)
    flops_tok = cfg.flops_per_token(seq)
    return {
        "params_m": round(cfg.num_params / 1e6, 2),
        "batch": batch, "seq": seq,
        "fwd_tokens_per_s": round(tokens / t_f, 1),
        "fwd_bwd_tokens_per_s": round(tokens / t_fb, 1),
        "fwd_mfu": round(tokens * flops_tok / t_f / 1e9 / peak_gflops, 4),
        "fwd_bwd_mfu": round(3 * tokens * flops_tok / t_fb / 1e9 / peak_gflops, 4),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    args = p.parse_args()
    repeats = 3 if args.quick else 5
    peak = matmul_gflops(1024 if args.quick else 2048, max(repeats, 10))
    out = {
        "bench": "model",
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, {jax.default_backend()}",
        "matmul_fp32_gflops": round(peak, 1),
        "tiny": bench_model(tiny_config(vocab_size=56), 64, 128, peak, repeats),
        "m100": bench_model(config_100m(), 4 if args.quick else 8, 256, peak, repeats),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
