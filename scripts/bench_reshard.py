"""A weight update's reshard into the JaxEngine's layout, Qwen2.5-0.5B shape, 8 CPU devices.

    python scripts/bench_reshard.py [--smoke] [--rounds 5] [--dtype bfloat16]

The learner holds its parameters on its own mesh (devices 0-3, `(data, fsdp, tensor) =
(1, 2, 2)`); the engine's mesh is devices 4-5 (`tensor` 2: Qwen2.5-0.5B's 14 heads and 2 kv
heads split two ways). Each round installs the learner's version in the engine's shardings
(`engine_programs(...).param_shardings`) three ways, timed interleaved so a shared machine's
load hits all alike:

    one_device_put   `models.params.reshard`: every tensor in one `jax.device_put` to the
                     target shardings (what `JaxEngine.update_weights` runs);
    per_tensor       one `device_put` per tensor (the install before `reshard`);
    from_host        the same one `device_put` from host NumPy copies (a version that came
                     over the gRPC stream: the host-to-device half of a remote update).

Reports each arm's median seconds and GB/s (parameter bytes / time) and checks every arm
lands in the engine's shardings with the learner's values. `--smoke`: 2 layers, a 1024-token
vocabulary, 2 rounds.
Prints one JSON line.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402 - XLA_FLAGS must precede the JAX import
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from pipelinerl_jax import sharding  # noqa: E402
from pipelinerl_jax.models import config_qwen2_5_0_5b, flat_params  # noqa: E402
from pipelinerl_jax.models.decoder_config import dtype_of  # noqa: E402
from pipelinerl_jax.models.params import reshard  # noqa: E402
from pipelinerl_jax.rollout.engine_programs import engine_programs  # noqa: E402
from pipelinerl_jax.rollout.jax_engine import engine_config  # noqa: E402
from pipelinerl_jax.models.factory import create_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    a = p.parse_args()
    rounds = a.rounds or (2 if a.smoke else 5)
    dtype = dtype_of(a.dtype)
    cfg = config_qwen2_5_0_5b(**({"num_layers": 2, "vocab_size": 1024} if a.smoke else {}))
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    devices = jax.devices()
    learner_mesh = sharding.make_mesh((1, 2, 2), devices[:4])
    engine_mesh = sharding.make_mesh((1, 1, 2), devices[4:6])
    t = time.perf_counter()
    model = create_model(cfg, learner_mesh, seed=0)  # born in the learner's layout
    learner = flat_params(model, host=False)
    build_s = time.perf_counter() - t
    ecfg = engine_config()
    ecfg.update(dtype=a.dtype, kv_layout="paged", max_seq_len=1024)
    progs = engine_programs(cfg, ecfg, engine_mesh)
    targets = {name: s for name, s in zip(
        flat_params(progs.params, host=False),
        jax.tree.leaves(progs.param_shardings))}
    names = sorted(learner)
    values = [learner[n] for n in names]
    dests = [targets[n] for n in names]
    host = [np.asarray(v) for v in jax.device_get(values)]
    nbytes = sum(v.nbytes for v in host)

    arms = {
        "one_device_put": lambda: reshard(values, dests),
        "per_tensor": lambda: [jax.device_put(v, d, may_alias=False)
                               for v, d in zip(values, dests)],
        "from_host": lambda: reshard(host, dests),
    }
    times = {k: [] for k in arms}
    for r in range(rounds + 1):  # round 0 warms up (not reported)
        for name, fn in arms.items():
            t = time.perf_counter()
            out = jax.block_until_ready(fn())
            dt = time.perf_counter() - t
            if r:
                times[name].append(dt)
            if r == rounds:  # the last round's results are checked
                for n, v, d, h in zip(names, out, dests, host):
                    assert v.sharding == d, (name, n, v.sharding, d)
                i = names.index("layers/0/attn/q_proj")
                np.testing.assert_array_equal(np.asarray(out[i]), host[i])
            del out
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(json.dumps({
        "model": "qwen2.5-0.5b shape" + (" (2 layers, vocab 1024)" if a.smoke else ""),
        "dtype": a.dtype, "param_bytes": int(nbytes), "tensors": len(names),
        "learner_mesh": "(1,2,2) on cpu:0-3", "engine_mesh": "(1,1,2) on cpu:4-5",
        "rounds": rounds, "learner_init_s": round(build_s, 2),
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        **{f"{k}_gb_per_s": round(nbytes / v / 1e9, 3) for k, v in med.items()},
        "per_tensor_over_one_device_put": round(med["per_tensor"] / med["one_device_put"], 3),
    }), flush=True)


if __name__ == "__main__":
    main()
