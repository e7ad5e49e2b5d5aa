"""Would a population mode (several seeds of a study cell in one program) make the staleness
grids cheaper on this machine? Issue 39 welcomed one; this measures the two programs a run
spends its time in, at the study's shapes, one seed against S seeds batched:

  step    a policy-gradient train step (forward and backward of the token log-probs, Adam) of
          the study's model (`tiny_config`: 0.4M parameters) on a packed batch like the
          learner's ([rows, 256]; 10 rows: the median of a protocol run), one seed vs S seeds
          `vmap`ped (their own parameters and optimizer states): `per_seed_speedup` =
          S x (one seed's time) / (S seeds' time); 1.0 means batching buys nothing.
  engine  the JaxEngine's tokens/s at 64 slots (one run's batch: 8 groups of 8) vs 64 x S
          slots (S seeds' batches in one engine, as a population would), 20-token prompts,
          `--new_tokens` new tokens each, no stop token.

    taskset -c 1 python scripts/bench_population.py [--seeds 2,4,8] [--repeats 20]
    python scripts/bench_population.py --small      # a smoke run (tests)

Run it pinned to one core to see what one grid run (pinned to one core) sees. Compile first,
then time. Prints ONE final JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pipelinerl_jax.models.decoder_config import tiny_config
from pipelinerl_jax.models.model import Decoder
from pipelinerl_jax.records import GenerationRequest, SamplingParams
from pipelinerl_jax.rollout.jax_engine import JaxEngine


def _median_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled before timing
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def step_speedups(cfg, seeds, rows: int, seq: int, repeats: int) -> dict:
    graphdef, _ = nnx.split(Decoder(cfg, nnx.Rngs(0)))
    opt = optax.adam(2e-4)

    def loss(params, ids, adv):
        logits = nnx.merge(graphdef, params)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -(jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0] * adv[:, None]).mean()

    def step(params, opt_state, ids, adv):
        updates, opt_state = opt.update(jax.grad(loss)(params, ids, adv), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, seq + 1)), jnp.int32)
    adv = jnp.asarray(rng.standard_normal(rows), jnp.float32)
    params = [nnx.split(Decoder(cfg, nnx.Rngs(s)))[1] for s in range(max(seeds))]
    one = _median_time(jax.jit(step), (params[0], opt.init(params[0]), ids, adv), repeats)
    out = {"one_seed_step_s": round(one, 4)}
    for s in seeds:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *params[:s])
        t = _median_time(jax.jit(jax.vmap(step)), (
            stacked, jax.vmap(opt.init)(stacked), jnp.stack([ids] * s), jnp.stack([adv] * s)),
            max(3, repeats // s))
        out[f"step_s_{s}_seeds"] = round(t, 4)
        out[f"step_per_seed_speedup_{s}"] = round(one * s / t, 3)
    return out


def engine_tokens_per_s(cfg, slots: int, new_tokens: int) -> float:
    engine = JaxEngine(Decoder(cfg, nnx.Rngs(0)), dict(max_slots=slots, max_seq_len=256,
                                                       dtype="float32"), version=0)
    rng = np.random.default_rng(0)

    def requests(n, tag):
        return [GenerationRequest(f"{tag}{i}", rng.integers(3, cfg.vocab_size, 20)
                                  .astype(np.int32), SamplingParams(max_new_tokens=new_tokens,
                                                                    seed=i)) for i in range(n)]
    try:
        engine.generate(requests(slots, "warm"))  # every program compiled
        t = time.perf_counter()
        done = engine.generate(requests(2 * slots, "timed"))
        return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t)
    finally:
        engine.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="2,4,8")
    p.add_argument("--rows", type=int, default=10)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--small", action="store_true", help="a smoke run: tiny shapes")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    cfg = tiny_config()
    if a.small:
        cfg = tiny_config(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                          head_dim=16)
        seeds, a.rows, a.seq, a.repeats, a.new_tokens = [2], 2, 32, 2, 4
    out = {"cpus_usable": len(os.sched_getaffinity(0)), "machine": platform.processor()
           or platform.machine(), "devices": jax.devices()[0].platform,
           "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
               nnx.state(Decoder(cfg, nnx.Rngs(0)), nnx.Param))),
           **step_speedups(cfg, seeds, a.rows, a.seq, a.repeats)}
    base = engine_tokens_per_s(cfg, 64 if not a.small else 4, a.new_tokens)
    out["engine_tokens_per_s_64_slots" if not a.small else "engine_tokens_per_s_base"] = round(base)
    for s in seeds:
        t = engine_tokens_per_s(cfg, (64 if not a.small else 4) * s, a.new_tokens)
        out[f"engine_tokens_per_s_x{s}_slots"] = round(t)
        out[f"engine_per_token_speedup_x{s}"] = round(t / base, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
