"""LoRA vs full fine-tuning on the Qwen2.5-0.5B shape (random weights): what a published
version weighs, how long publication takes, what the learner holds, how long a step takes.

    python scripts/bench_lora.py [--layers N] [--rank 16] [--steps 3] [--seqs 4]
                                 [--prompt 32] [--completion 96] [--smoke] [--checkpoint DIR]

Bytes are exact and hardware-independent: for the full 24-layer shape they come from the
abstract state (`nnx.eval_shape` / `jax.eval_shape`; nothing allocated), rank `--rank` on all
seven projections of every layer, float32 parameters, AdamW (two float32 moments):

* `publish_bytes`: the flat dict one version carries (full: every weight; LoRA: the adapters);
* `learner_state_bytes`: parameters + optimizer state the learner holds (LoRA: the frozen
  base, the adapters and their moments).

Timings run a model of the same shape with `--layers` decoder layers (default: all 24 on an
accelerator, 4 on CPU, where the full model's float32 step would need ~10 GB and minutes a
step on a shared host; the vocabulary and widths stay Qwen2.5-0.5B's), side by side in one
process, full then LoRA:

* `publish_s`: one version from the learner's device arrays to a subscriber's callback over
  the real weight stream (`WeightPublisher` -> `WeightSubscriber` on loopback gRPC): device
  fetch, flattening, framing, checksums, receipt (median of `--publishes`);
* `compile_s` and `step_s`: the real train step (`learner.loop.make_step`: PPO loss, AdamW,
  micro-batches), compile apart, then the median of `--steps` steps.

The timed model's weights are a random HF checkpoint loaded as the learner loads one
(`from_pretrained` onto the mesh; for LoRA, `lora.attach_lora` then adds the adapters, as
`learner.loop` does): `--checkpoint DIR` (its shape must be the timed one, e.g.
`python -m pipelinerl_jax.models.random_checkpoint --out DIR [--layers N]`), else one written
host-side with NumPy into a temporary directory (nothing compiled to make it: a whole-model
jitted init took over 3 minutes to compile on an H200). Progress lines go to stderr.

Prints one JSON line with `publish_bytes_ratio` and `learner_state_bytes_ratio` (LoRA / full,
at the full shape) and the timings' ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from pipelinerl_jax import sharding  # noqa: E402
from pipelinerl_jax.learner import batching, loop, train_step as ts  # noqa: E402
from pipelinerl_jax.models import Decoder, flat_params, from_pretrained, load_config  # noqa: E402
from pipelinerl_jax.models.lora import LoRASpec, add_lora, attach_lora  # noqa: E402
from pipelinerl_jax.models.random_checkpoint import (SHAPES, check_checkpoint_shape,  # noqa: E402
                                                     write_random_checkpoint)
from pipelinerl_jax.run_config import base_config  # noqa: E402
from pipelinerl_jax.transport.weight_version import WeightVersion  # noqa: E402
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber  # noqa: E402
from scripts.bench_progress import progress  # noqa: E402
from scripts.bench_real_size import synthetic_rollouts  # noqa: E402


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def abstract_bytes(cfg, spec, optimizer) -> dict:
    """Exact bytes of the full and the LoRA learner, from shapes alone."""
    def build(lora):
        model = Decoder(cfg, nnx.Rngs(0))
        return add_lora(model, spec, nnx.Rngs(1)) if lora else model
    full = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build(False)), nnx.Param))
    lora_model = nnx.eval_shape(lambda: build(True))
    adapters = nnx.to_pure_dict(nnx.state(lora_model, nnx.LoRAParam))
    frozen = nnx.to_pure_dict(nnx.state(lora_model, nnx.All(nnx.Param,
                                                            nnx.Not(nnx.LoRAParam))))
    full_opt = _nbytes(jax.eval_shape(optimizer.init, full))
    lora_opt = _nbytes(jax.eval_shape(optimizer.init, adapters))
    n_full, n_adapt = (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))
                       for t in (full, adapters))
    out = {"params": n_full, "adapter_params": n_adapt,
           "adapter_param_fraction": round(n_adapt / n_full, 5),
           "full": {"publish_bytes": _nbytes(full), "param_bytes": _nbytes(full),
                    "optimizer_bytes": full_opt,
                    "learner_state_bytes": _nbytes(full) + full_opt},
           "lora": {"publish_bytes": _nbytes(adapters), "param_bytes": _nbytes(adapters),
                    "frozen_bytes": _nbytes(frozen), "optimizer_bytes": lora_opt,
                    "learner_state_bytes": _nbytes(adapters) + _nbytes(frozen) + lora_opt}}
    out["publish_bytes_ratio"] = round(out["lora"]["publish_bytes"]
                                       / out["full"]["publish_bytes"], 5)
    out["learner_state_bytes_ratio"] = round(out["lora"]["learner_state_bytes"]
                                             / out["full"]["learner_state_bytes"], 5)
    return out


def time_publication(params, repeats: int) -> dict:
    """Learner device arrays -> a subscriber's callback over the real weight stream."""
    got, done = {}, threading.Event()

    def on_weights(message):
        got["n"] = message.payload_bytes()
        done.set()

    pub = WeightPublisher()
    sub = WeightSubscriber(pub.address, on_weights)
    times = []
    try:
        for v in range(repeats + 1):  # version 0 warms the stream up
            done.clear()
            t = time.perf_counter()
            flat = flat_params(params)  # device -> host, flattened (the learner's shipper)
            pub.publish(WeightVersion("full").carrying(v, tensors=flat))
            if not done.wait(600):
                raise TimeoutError(f"version {v} never reached the subscriber")
            if v:
                times.append(time.perf_counter() - t)
    finally:
        sub.close()
        pub.stop()
    return {"publish_s": round(float(np.median(times)), 4),
            "publish_times_s": [round(x, 4) for x in times], "received_bytes": got["n"]}


def time_learner(cfg, spec, a, ckpt: str) -> dict:
    """The learner of `cfg` (weights from `ckpt`; LoRA adapters of `spec` when given) timed."""
    kind = "full" if spec is None else "lora"
    run = base_config()
    run.learner.micro_batches = a.micro_batches
    mesh = sharding.make_mesh((1, 1, 1))
    t = time.perf_counter()
    model = from_pretrained(ckpt, dtype=cfg.dtype, param_dtype=cfg.param_dtype, mesh=mesh)
    if spec is not None:  # fresh adapters (A random, B zero), placed as the learner places them
        attach_lora(model, spec, mesh, seed=1)
    progress(f"{kind}: model loaded{' and adapters attached' if spec else ''} in "
             f"{time.perf_counter() - t:.1f} s")
    optimizer, _ = ts.make_optimizer(run.learner.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    step = loop.make_step(run, model, optimizer, mesh, state)
    seq = a.prompt + a.completion
    packed = batching.pack(synthetic_rollouts(a.seqs, a.prompt, a.completion, cfg.vocab_size), 0,
                           num_seqs=a.seqs, chunks=a.micro_batches, pack_len=seq,
                           completion_len=a.completion, row_divisor=1)
    batch = ts.place_batch(packed.arrays, mesh)
    t = time.perf_counter()
    compiled = step.jitted.lower(state, batch, step.hparams).compile()
    compile_s = time.perf_counter() - t
    progress(f"{kind}: train step compiled in {compile_s:.1f} s")
    t = time.perf_counter()
    state, metrics = compiled(state, batch, step.hparams)  # first run (allocations)
    jax.block_until_ready(state)
    first_s = time.perf_counter() - t
    progress(f"{kind}: first step {first_s:.2f} s")
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError(f"non-finite loss {float(metrics['loss'])}")
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch, step.hparams)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
        progress(f"{kind}: timed step {len(times)}/{a.steps} {times[-1]:.3f} s")
    held = _nbytes(state.params) + _nbytes(state.opt_state) + _nbytes(
        ts.frozen_params(state) or {})
    out = {"compile_s": round(compile_s, 2), "first_step_s": round(first_s, 3),
           "step_s": round(float(np.median(times)), 4),
           "step_times_s": [round(x, 3) for x in times],
           "learner_state_bytes": held, "publish_bytes": _nbytes(state.params)}
    out.update(time_publication(state.params, a.publishes))
    progress(f"{kind}: publication {out['publish_s']:.3f} s (median of {a.publishes})")
    del state, compiled
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="a tiny model, seconds (tests)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the timed model (default: 24, or 4 on CPU)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--publishes", type=int, default=3)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--completion", type=int, default=96)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--checkpoint", default=None,
                   help="a random HF checkpoint of the timed shape (default: one written "
                        "host-side into a temporary directory)")
    a = p.parse_args(argv)
    progress(f"started: jax {jax.__version__}, args {vars(a)}")
    cpu = jax.default_backend() == "cpu"
    progress(f"backend ready: {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    # float32 parameters and compute (the shapes' defaults)
    shape = SHAPES["tiny-qwen2" if a.smoke else "qwen2.5-0.5b"]()
    if a.smoke:
        a.rank, a.steps, a.publishes, a.seqs, a.prompt, a.completion = 4, 1, 1, 4, 8, 8
    if a.checkpoint and not a.layers:  # its depth; every other dimension is checked below
        a.layers = load_config(a.checkpoint).num_layers
    layers = a.layers or (shape.num_layers if a.smoke or not cpu else 4)
    spec = LoRASpec(rank=a.rank, alpha=a.alpha)
    optimizer, _ = ts.make_optimizer(base_config().learner.optimizer)
    out = {"model": "tiny" if a.smoke else "qwen2.5-0.5b-shape", "rank": a.rank,
           "targets": list(spec.targets), "devices": f"1 x {jax.devices()[0].platform}",
           "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
    sizes = abstract_bytes(shape, spec, optimizer)
    out["bytes_full_shape"] = sizes
    out["publish_bytes_ratio"] = sizes["publish_bytes_ratio"]
    out["learner_state_bytes_ratio"] = sizes["learner_state_bytes_ratio"]

    timed = shape.replace(num_layers=layers)
    out["timed"] = {"layers": layers, "seqs": a.seqs, "seq_len": a.prompt + a.completion,
                    "micro_batches": a.micro_batches}
    tmp = None
    try:
        t = time.perf_counter()
        if a.checkpoint:
            ckpt = a.checkpoint
        else:  # host-side NumPy weights: no whole-model init to compile
            tmp = tempfile.mkdtemp(prefix="bench_lora_")
            ckpt = write_random_checkpoint(timed, os.path.join(tmp, "random"), seed=0)
        check_checkpoint_shape(ckpt, timed)
        progress(f"checkpoint ready: {ckpt} ({'given' if a.checkpoint else 'written'} in "
                 f"{time.perf_counter() - t:.1f} s)")
        out["checkpoint"] = os.path.abspath(ckpt)
        for name, lora in (("full", None), ("lora", spec)):
            out["timed"][name] = time_learner(timed, lora, a, ckpt)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    f, l = out["timed"]["full"], out["timed"]["lora"]
    out["timed"]["publish_s_ratio"] = round(l["publish_s"] / f["publish_s"], 4)
    out["timed"]["step_s_ratio"] = round(l["step_s"] / f["step_s"], 4)
    out["timed"]["publish_bytes_ratio"] = round(l["publish_bytes"] / f["publish_bytes"], 5)
    out["timed"]["learner_state_bytes_ratio"] = round(
        l["learner_state_bytes"] / f["learner_state_bytes"], 5)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
