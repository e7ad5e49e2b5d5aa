"""Weight publication's cost to the learner: blocking (before) vs overlapped (after).

    python scripts/bench_weight_sync.py [--steps 6] [--batch 4] [--seq 128] [--small]
                                        [--model 100m|qwen2.5-0.5b]

A ~100M-parameter Llama (`config_100m`) trains with a jitted, donating step (forward +
backward + SGD); after every step its params are published as the learner does, through a
real `StreamSink` (gRPC weight publisher on loopback). 'blocking' is the learner before the
change (`host_params`, flatten, ship, then the next step); 'overlapped' is
`learner.publication.Publication` (snapshot on device, fetch and ship on a background thread).
Reports, per mode, the median step time, the learner's time blocked on publication and that
as a fraction of the step time. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.learner import multihost
from pipelinerl_jax.models import flat_params
from pipelinerl_jax.learner.publication import Publication
from pipelinerl_jax.models import config_100m, config_qwen2_5_0_5b, tiny_config, token_logprobs
from pipelinerl_jax.transport.weight_sink import StreamSink
from pipelinerl_jax.transport.weights import WeightPublisher


MODELS = {"100m": config_100m, "qwen2.5-0.5b": config_qwen2_5_0_5b}


def make_step(graphdef):
    def loss(params, ids):
        logits = nnx.merge(graphdef, params)(ids)
        return -jnp.mean(token_logprobs(logits[:, :-1], ids[:, 1:]))

    def step(params, ids):
        grads = jax.grad(loss)(params, ids)
        return jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads)
    return jax.jit(step, donate_argnums=0)


def run(mode: str, cfg, steps: int, batch: int, seq: int) -> dict:
    graphdef, params = nnx.split(create_model(cfg))
    params = jax.tree.map(jnp.asarray, nnx.to_pure_dict(params))
    step = make_step(graphdef)
    ids = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size, jnp.int32)
    sink = StreamSink(WeightPublisher("127.0.0.1:0"))

    def ship(version, host):
        flat = flat_params(host)
        sink.publish(version, flat)
        return flat

    pub = Publication(ship) if mode == "overlapped" else None
    params = step(params, ids)  # compile
    jax.block_until_ready(params)
    step_s, sync_s = [], []
    for version in range(1, steps + 1):
        t = time.perf_counter()
        params = step(params, ids)
        jax.block_until_ready(params)
        t_sync = time.perf_counter()
        if pub is None:
            ship(version, multihost.host_params(params))
        else:
            pub.submit(version, params)
        sync_s.append(time.perf_counter() - t_sync)
        step_s.append(time.perf_counter() - t)
    if pub is not None:
        pub.close()
    sink.close()
    med = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]  # noqa: E731 - first one warms up
    return {"step_s": round(med(step_s), 4), "publish_blocking_s": round(med(sync_s), 4),
            "sync_fraction": round(med(sync_s) / med(step_s), 4)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--small", action="store_true", help="the tiny model (a smoke run)")
    p.add_argument("--model", default="100m", choices=sorted(MODELS),
                   help="100m (config_100m) or qwen2.5-0.5b (its config's dimensions)")
    a = p.parse_args()
    cfg = tiny_config() if a.small else MODELS[a.model]()
    out = {"params_m": round(cfg.num_params / 1e6, 2), "batch": a.batch, "seq": a.seq,
           "devices": str(jax.devices()[0].platform)}
    for mode in ("blocking", "overlapped"):
        out[mode] = run(mode, cfg, a.steps, a.batch, a.seq)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
