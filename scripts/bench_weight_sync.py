"""Weight publication's cost: to the learner (blocking vs overlapped), and from `publish` to
live in a JaxEngine (full vs LoRA, with the host copies a full version takes).

    python scripts/bench_weight_sync.py [--steps 6] [--batch 4] [--seq 128] [--small]
                                        [--model 100m|qwen2.5-0.5b]
    python scripts/bench_weight_sync.py --live [--model qwen2.5-0.5b] [--versions 5]
                                        [--payload grpc|socket|both]

A ~100M-parameter Llama (`config_100m`) trains with a jitted, donating step (forward +
backward + SGD); after every step its params are published as the learner does, through a
real `StreamSink` (gRPC weight publisher on loopback). 'blocking' is the learner before the
change (`host_params`, flatten, ship, then the next step); 'overlapped' is
`learner.publication.Publication` (snapshot on device, fetch and ship on a background thread).
Reports, per mode, the median step time, the learner's time blocked on publication and that
as a fraction of the step time.

`--live`: a bfloat16 model of the chosen shape; each version goes from fresh host arrays
through a real `WeightPublisher` / `WeightSubscriber` (loopback gRPC) into a `JaxEngine`
(bfloat16, the dtype the learner publishes: no cast) until the engine serves it (the
median over `--versions` timed versions, after one untimed warm-up version):
'full' (every weight) and 'lora' (rank 16, alpha 32, every projection: only the adapters,
served unmerged). `full_host_copies` counts the full-size copies a full version takes from
the learner's device to the engine's, each measured: the on-device snapshot and the
device-to-host fetch (pointer comparison: on CPU the fetch is a view), frame assembly (bytes
the publisher assembled / payload, whatever the number of subscribers), the subscriber's
buffer, a host cast (bytes whose dtype differs from the engine's) and the host-to-device
transfer (pointer comparison). Prints one JSON line. `--payload` picks the publisher's payload
path ('grpc', the default: chunk frames on the stream; 'socket': a ticketed TCP
connection, no frame assembly); 'both' runs the two in turn, each in its own process (one
process holding both ran out of memory on a 23 GB machine), and reports each under its name,
with `full_host_copies` counted for each.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.learner import multihost
from pipelinerl_jax.models import flat_params
from pipelinerl_jax.learner.publication import Publication
from pipelinerl_jax.models import config_100m, config_qwen2_5_0_5b, tiny_config, token_logprobs
from pipelinerl_jax.models.lora import LoRASpec, adapter_params
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.transport.weight_sink import StreamSink
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber


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


def _pointer(a) -> int:
    return a.unsafe_buffer_pointer() if isinstance(a, jax.Array) else a.ctypes.data


def learner_side_copies(cfg) -> dict:
    """The learner's side of a full version (`Publication.submit` + its thread): the on-device
    snapshot, then the device-to-host fetch; 1 where a copy was made."""
    params = nnx.state(create_model(cfg), nnx.Param)
    leaf = jax.tree.leaves(params)[0]
    snap = multihost.snapshot_params(params)
    snap_leaf = jax.tree.leaves(snap)[0]
    host_leaf = jax.tree.leaves(jax.device_get(snap))[0]
    return {"snapshot": int(_pointer(snap_leaf) != _pointer(leaf)),
            "device_to_host": int(_pointer(host_leaf) != _pointer(snap_leaf))}


def publish_to_live(cfg, lora, versions: int, payload_path: str = "grpc") -> dict:
    """Median seconds from `publish` to the engine serving the version; full-copy counts."""
    learner = create_model(cfg, lora=lora)
    flat = flat_params(learner)
    payload = adapter_params(flat) if lora is not None else flat
    base_sha = hashlib.sha256(b"bench base").hexdigest()  # what describe_run would hash
    describes = WeightVersion("full") if lora is None else WeightVersion("lora", base_sha, lora)
    del learner, flat
    engine = JaxEngine(create_model(cfg), dict(max_slots=1, max_seq_len=64,
                                                        dtype="bfloat16"),
                       version=0, serves=describes)
    pub = WeightPublisher("127.0.0.1:0", payload=payload_path)
    received = {}

    def on_weights(message):
        received["tensors"] = message.tensors
        engine.update_weights(message, message.version)

    sub = WeightSubscriber(pub.address, on_weights, expected_shapes=engine.weight_shapes(),
                           accepts=engine.serves)
    times, nbytes = [], sum(a.nbytes for a in payload.values())
    try:
        for v in range(1, versions + 2):  # version 1 warms up (first transfers, threads)
            fresh = {k: np.array(a) for k, a in payload.items()}  # the learner's fetch
            t = time.perf_counter()
            pub.publish(describes.carrying(v, tensors=fresh))
            if not sub.wait_for_version(v, 1800):
                raise TimeoutError(f"version {v} never went live: {sub.last_error}")
            assert engine.version == v
            if v > 1:
                times.append(time.perf_counter() - t)
        live = flat_params(engine.params, host=False)
        name = max(received["tensors"], key=lambda k: received["tensors"][k].nbytes)
        copies = {
            "frame_assembly": pub.latest_assembled_bytes / nbytes,
            # every chunk (or the socket payload's recv_into) lands in the version buffer once
            "subscriber_buffer": 1,
            "host_cast": sum(a.nbytes for a in received["tensors"].values()
                             if a.dtype != np.dtype(engine.dtype)) / nbytes,
            "host_to_device": int(_pointer(live[name]) != _pointer(received["tensors"][name])),
        }
    finally:
        sub.close()
        pub.stop()
        engine.close()
    return {"publish_to_live_s": round(statistics.median(times), 4),
            "publish_to_live_times_s": [round(x, 4) for x in times],
            "payload_bytes": nbytes, "copies": copies}


def live(a) -> dict:
    cfg = (tiny_config if a.small else MODELS[a.model])(dtype=jnp.bfloat16,
                                                        param_dtype=jnp.bfloat16)
    out = {"params_m": round(cfg.num_params / 1e6, 2), "devices": jax.devices()[0].platform}
    if a.payload == "both":  # each path in its own process, one after the other (memory)
        for payload in ("grpc", "socket"):
            argv = [sys.executable, __file__, "--live", f"--model={a.model}",
                    f"--versions={a.versions}", f"--payload={payload}"] + \
                (["--small"] if a.small else [])
            done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
            arm = json.loads(done.stdout.strip().splitlines()[-1])
            out[payload] = {k: v for k, v in arm.items() if k not in out}
        return out
    return {**out, **live_arm(cfg, a.versions, a.payload, learner_side_copies(cfg))}


def live_arm(cfg, versions: int, payload: str, learner_copies: dict) -> dict:
    full = publish_to_live(cfg, None, versions, payload)
    lora = publish_to_live(cfg, LoRASpec(16, 32.0), versions, payload)
    copies = {**learner_copies, **full["copies"]}
    return {"full_host_copies": round(sum(copies.values()), 3), "full_copies": copies,
            "full_publish_to_live_s": full["publish_to_live_s"],
            "lora_publish_to_live_s": lora["publish_to_live_s"],
            "lora_to_full_publish_to_live_ratio": round(
                lora["publish_to_live_s"] / full["publish_to_live_s"], 4),
            "full_bytes": full["payload_bytes"], "lora_bytes": lora["payload_bytes"],
            "full_times_s": full["publish_to_live_times_s"],
            "lora_times_s": lora["publish_to_live_times_s"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--small", action="store_true", help="the tiny model (a smoke run)")
    p.add_argument("--model", default="100m", choices=sorted(MODELS),
                   help="100m (config_100m) or qwen2.5-0.5b (its config's dimensions)")
    p.add_argument("--live", action="store_true",
                   help="publish -> live in a JaxEngine, full vs LoRA rank 16")
    p.add_argument("--versions", type=int, default=5,
                   help="--live: timed versions per arm (after one untimed warm-up version)")
    p.add_argument("--payload", default="grpc", choices=("grpc", "socket", "both"),
                   help="--live: the weight publisher's payload path (both: side by side)")
    a = p.parse_args()
    if a.live:
        print(json.dumps(live(a)))
        return
    cfg = tiny_config() if a.small else MODELS[a.model]()
    out = {"params_m": round(cfg.num_params / 1e6, 2), "batch": a.batch, "seq": a.seq,
           "devices": str(jax.devices()[0].platform)}
    for mode in ("blocking", "overlapped"):
        out[mode] = run(mode, cfg, a.steps, a.batch, a.seq)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
