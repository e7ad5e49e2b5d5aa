"""Decode attention alone, dense engine layout vs paged reference, timed interleaved.

    python scripts/bench_decode_attention.py [--smoke] [--batch 32] [--cache-len 64]
                                             [--layers 24] [--rounds 40]

One jitted program per layout runs the attention of every layer of a Qwen2.5-0.5B-shaped
model (projections, RoPE, the step's K/V write, attention, output projection; no MLP, no
logits) for one decode step at `--batch` rows over `--cache-len` cached positions: the
dense engine's `decode_step._attention` over its `[B, K, X, S]` / `[B, K, S, X]` cache, and
`decode_step._paged_attention` over pages of 16 (the reference, `attention_kernel` =
'reference', each row's pages shuffled through the pool). Called alternately `--rounds`
times in one process, so the load of a shared machine hits both alike: reports each one's
median milliseconds and the median (and quartiles) of the per-round dense / paged time
ratio (paged's speed as a fraction of dense's), plus what XLA emitted for each (transposes,
copies, gathers). `--smoke`: 2 layers, 4 rounds. Prints one JSON line.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import argparse  # noqa: E402 - XLA_FLAGS must precede the JAX import
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from pipelinerl_jax.models import Decoder, config_qwen2_5_0_5b, init_paged_cache  # noqa: E402
from pipelinerl_jax.models.model import rope_frequencies  # noqa: E402
from pipelinerl_jax.rollout import decode_step  # noqa: E402

PAGE = 16


def attention_program(graphdef, cfg, layout: str, cache_len: int):
    """A jitted program: every layer's decode attention in `layout`, the residual carried
    (`h + attention(h)`), the cache donated and returned."""
    n_pages = cache_len // PAGE

    def step(params, cache, token_b, pos_b, tables_bn):
        model = nnx.merge(graphdef, params)
        inv_freq = rope_frequencies(cfg)
        h_bd = jnp.take(model.embed[...], token_b, axis=0)
        new = []
        for i, layer in enumerate(model.layers):
            if layout == "dense":
                a, ck, cv = decode_step._attention(layer.attn, h_bd, pos_b, inv_freq,
                                                   cache.k[i], cache.v[i], cache_len)
                new.append((ck, cv))
            else:
                a, pool = decode_step._paged_attention(layer.attn, h_bd, pos_b, inv_freq,
                                                       cache.kv[i], tables_bn, n_pages)
                new.append(pool)
            h_bd = h_bd + a
        if layout == "dense":
            return h_bd, cache._replace(k=tuple(c[0] for c in new), v=tuple(c[1] for c in new))
        return h_bd, cache._replace(kv=tuple(new))
    return jax.jit(step, donate_argnums=(1,))


def _random(cache, rng):
    def fill(x):
        return jnp.asarray(rng.normal(size=x.shape), x.dtype)
    return jax.tree.map(fill, cache)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cache-len", type=int, default=64, help="a multiple of 16")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    a = p.parse_args()
    layers = a.layers or (2 if a.smoke else 24)
    rounds = a.rounds or (4 if a.smoke else 40)
    b, s = a.batch, a.cache_len
    cfg = config_qwen2_5_0_5b(num_layers=layers, vocab_size=1024)  # the logits are not run
    graphdef, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    num_pages = b * (s // PAGE) + 1
    tables = jnp.asarray(rng.permutation(num_pages - 1)[:b * (s // PAGE)]
                         .reshape(b, s // PAGE).astype(np.int32))
    token = jnp.asarray(rng.integers(0, cfg.vocab_size, b), jnp.int32)
    pos = jnp.asarray(rng.integers(s // 2, s - 1, b), jnp.int32)
    caches = {"dense": _random(decode_step.init_engine_cache(cfg, b, s), rng),
              "paged": _random(init_paged_cache(cfg, num_pages, PAGE), rng)}
    fns, emitted = {}, {}
    for layout in caches:
        fns[layout] = attention_program(graphdef, cfg, layout, s)
        hlo = fns[layout].lower(params, caches[layout], token, pos,
                                tables).compile().as_text()
        emitted[layout] = {op: len(re.findall(rf" {op}\(", hlo))
                           for op in ("transpose", "copy", "gather", "dot")}
        out, caches[layout] = fns[layout](params, caches[layout], token, pos, tables)  # warm
    times = {layout: [] for layout in fns}
    for _ in range(rounds):
        for layout, fn in fns.items():
            t = time.perf_counter()
            out, caches[layout] = fn(params, caches[layout], token, pos, tables)
            jax.block_until_ready(out)
            times[layout].append(time.perf_counter() - t)
    ratio = [d / q for d, q in zip(times["dense"], times["paged"])]
    print(json.dumps({
        "batch": b, "cache_len": s, "layers": layers, "rounds": rounds,
        "dense_ms": round(1e3 * float(np.median(times["dense"])), 2),
        "paged_ms": round(1e3 * float(np.median(times["paged"])), 2),
        "paged_speed_vs_dense": round(float(np.median(ratio)), 3),
        "paged_speed_vs_dense_quartiles": [round(float(np.percentile(ratio, q)), 3)
                                           for q in (25, 75)],
        "hlo_ops": emitted}), flush=True)


if __name__ == "__main__":
    main()
