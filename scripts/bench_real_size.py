"""Real-size benchmark: a Qwen2.5-0.5B-shaped model through the sharded learner and the engine.

    python scripts/bench_real_size.py [--smoke] [--param-dtype bfloat16] [--dtype bfloat16]
                                      [--only learner|engine] [--workdir DIR] [--mesh 1,1,1]
                                      [--seqs N] [--micro-batches M] [--steps K]
                                      [--kv-layout dense|paged|both] [--attention-kernel K]
                                      [--repeats R]

Loads a random HF checkpoint with Qwen2.5-0.5B's config dimensions (`--checkpoint DIR`, e.g.
`python -m pipelinerl_jax.models.random_checkpoint --out DIR`; else one written host-side with
NumPy into --workdir, which a rerun reuses: nothing downloaded, nothing compiled to make it)
as the learner does and times the real
train step (PPO loss, AdamW, micro-batches): per-device parameter/optimizer bytes, XLA's
temporary (activation) bytes, step time, tokens/s and MFU against the matmul peak measured in
the same run in the compute dtype (best of 5, just before each timed step); also the AdamW update alone (`optimizer_s`,
memory-bound, grows with the parameters not the tokens) and the MFU of the rest of the step.
On CPU: 8 virtual devices (mesh data=1 x fsdp=4 x tensor=2) sharing the host's cores, float32
compute, 8 seqs x 128 tokens, MFU against one device's peak; `--mesh 1,1,1` runs the learner
on one device instead (the 8 virtual devices time-share the cores and their collectives are
memory copies, an artifact of emulating a mesh on one CPU). On GPU/TPU: every device on the fsdp axis, bf16 compute, 32 seqs x 512 tokens,
MFU against the summed peak of the devices. Then the JaxEngine (one device) decodes at batch
1/8/32 and its tokens/s is compared with the rooflines measured in the same run: memory
bandwidth (a large on-device copy; each decode step reads the weights and the live KV) and
compute (the matmul peak, 2·params FLOPs a token), the median of `--repeats` timed rounds
(default 3); `--kv-layout both` builds the paged KV cache's engine too (same KV tokens, pages
of 16) and times the two interleaved (dense, paged, dense, paged, ... on the same prompts
within a round), reporting paged's share of the roofline over dense's as the median of the
per-round ratios, with every round's ratio and their min/max (load drift between runs minutes
apart moved this ratio by more than the 8% it had to resolve).
`--param-dtype bfloat16`: bf16 master
weights (float32 optimizer state; see learner/train_step.py). `--smoke`: the tiny model, a
few seconds. Prints one JSON line; progress lines (timestamped, each phase) go to stderr.
"""
from __future__ import annotations

import os

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={N_DEVICES}")

import argparse  # noqa: E402 - XLA_FLAGS must precede the JAX import
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from pipelinerl_jax import sharding  # noqa: E402
from pipelinerl_jax.learner import batching, train_step as ts  # noqa: E402
from pipelinerl_jax.losses import get_loss  # noqa: E402
from pipelinerl_jax.models import ModelConfig, from_pretrained  # noqa: E402
from pipelinerl_jax.models.decoder_config import dtype_of  # noqa: E402
from pipelinerl_jax.models.random_checkpoint import (SHAPES, check_checkpoint_shape,  # noqa: E402
                                                     write_random_checkpoint)
from pipelinerl_jax.rollout import engine_memory  # noqa: E402
from pipelinerl_jax.rollout.jax_engine import JaxEngine  # noqa: E402
from pipelinerl_jax.run_config import optimizer_config  # noqa: E402
from pipelinerl_jax.records import GenerationRequest, Rollout, SamplingParams  # noqa: E402
from scripts.bench_model import matmul_gflops  # noqa: E402
from scripts.bench_progress import progress  # noqa: E402

def _best_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def measured_peaks(n: int, repeats: int, dtype, copy_bytes: int) -> dict:
    """Matmul FLOP/s in `dtype` (n x n x n, `bench_model.matmul_gflops`) and copy bandwidth
    (bytes read + written of a `copy_bytes` array, past the caches) on device 0: the best of
    `repeats` runs (a peak is what the hardware can reach; a median of 3 on this shared 2-core
    VM read 123-343 GFLOP/s in runs minutes apart, 2026-12-01)."""
    flops = matmul_gflops(n, repeats, dtype) * 1e9
    big = jnp.ones(copy_bytes // 4, jnp.float32)
    cp = jax.jit(lambda x: x * 1.0001)
    bw = 2 * big.nbytes / _best_time(lambda: cp(big), repeats)
    return {"matmul_gflops": flops / 1e9, "copy_gbytes_s": bw / 1e9}


def synthetic_rollouts(n: int, prompt: int, completion: int, vocab: int):
    """`n` random rollouts (groups of 4, alternating rewards) for a timed learner step."""
    rng = np.random.default_rng(0)
    return [Rollout(prompt_ids=rng.integers(3, vocab, prompt).astype(np.int32),
                    completion_ids=rng.integers(3, vocab, completion).astype(np.int32),
                    logp_behaviour=-rng.uniform(0.5, 4.0, completion).astype(np.float32),
                    version=np.zeros(completion, np.int32),
                    kv_version=np.zeros(completion, np.int32), reward=float(i % 2),
                    advantage=float(rng.normal()), group_id=f"g-{i // 4}", group_size=4)
            for i in range(n)]


def _device0_bytes(tree) -> int:
    d0 = jax.devices()[0]
    return int(sum(s.data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")
                   for s in x.addressable_shards if s.device == d0))


def bench_learner(ckpt: str, cfg: ModelConfig, a, first_peak: float) -> dict:
    """The learner's step. Each timed step follows its own matmul-peak measurement and its MFU
    is against that peak (the median over steps is reported): this VM's peak drifts by up to
    ~30% within minutes (307-423 GFLOP/s, 2026-12-01), so a peak taken once would misstate it.
    `mfu_vs_best_peak` is the conservative reading: against the highest peak of the run
    (`first_peak`, measured before loading the model, included)."""
    mesh = sharding.make_mesh(a.mesh)
    t = time.perf_counter()
    model = from_pretrained(ckpt, dtype=a.dtype, param_dtype=a.param_dtype, mesh=mesh)
    progress(f"learner: checkpoint loaded onto mesh {a.mesh} in {time.perf_counter() - t:.1f} s")
    optimizer, _ = ts.make_optimizer(optimizer_config())
    t = time.perf_counter()
    state = ts.init_state(model, optimizer, mesh)
    jax.block_until_ready(state)
    progress(f"learner: optimizer state initialised in {time.perf_counter() - t:.1f} s")
    step = ts.make_train_step(nnx.graphdef(model), optimizer, get_loss("ppo"), mesh=mesh,
                              state_sharding=ts.state_shardings(state),
                              micro_batches=a.micro_batches)
    seq = a.prompt + a.completion
    packed = batching.pack(synthetic_rollouts(a.seqs, a.prompt, a.completion, cfg.vocab_size), 0,
                           num_seqs=a.seqs, chunks=a.micro_batches, pack_len=seq,
                           completion_len=a.completion, row_divisor=sharding.batch_divisor(mesh))
    batch = ts.place_batch(packed.arrays, mesh)
    t = time.perf_counter()
    compiled = step.jitted.lower(state, batch, step.hparams).compile()  # the learner's step
    progress(f"learner: train step compiled in {time.perf_counter() - t:.1f} s "
             f"({a.seqs} seqs x {a.prompt + a.completion} tokens)")
    try:  # XLA's scratch (activations) for one step, where the backend reports it
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - optional figure
        temp = None
    t = time.perf_counter()
    state, metrics = compiled(state, batch, step.hparams)  # warm up
    jax.block_until_ready(state)
    first_s = time.perf_counter() - t
    progress(f"learner: first step {first_s:.2f} s")
    if not np.isfinite(float(metrics["loss"])):
        raise FloatingPointError(f"non-finite loss {float(metrics['loss'])}")
    # CPU: the devices share this host's cores, so MFU is against one device's matmul peak
    scale = 1 if jax.default_backend() == "cpu" else mesh.size
    times, peaks = [], []
    for _ in range(a.steps):
        peaks.append(scale * matmul_gflops(a.matmul_n, 5, dtype_of(a.dtype)))
        t = time.perf_counter()
        state, metrics = compiled(state, batch, step.hparams)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
        progress(f"learner: timed step {len(times)}/{a.steps} {times[-1]:.3f} s "
                 f"(matmul peak before it {peaks[-1]:.0f} GFLOP/s)")
    opt_s = _optimizer_time(optimizer, state, step.hparams["optimizer"], a.steps)
    progress(f"learner: optimizer update alone {opt_s:.3f} s")
    tokens = a.seqs * seq
    flops = 3 * cfg.flops_per_token(seq) * tokens
    med = lambda xs: float(np.median(xs))  # noqa: E731
    step_s = med(times)
    return {"mesh": "x".join(map(str, a.mesh)), "dtype": a.dtype,
            "param_dtype": a.param_dtype, "micro_batches": a.micro_batches,
            "seqs": a.seqs, "seq_len": seq, "first_step_s": round(first_s, 3),
            "step_s": round(step_s, 4), "step_times_s": [round(x, 3) for x in times],
            "loss": round(float(metrics["loss"]), 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "peak_gflops_before_steps": [round(p, 1) for p in peaks],
            "mfu": round(med([flops / s / 1e9 / p for s, p in zip(times, peaks)]), 4),
            "mfu_vs_best_peak": round(flops / step_s / 1e9 / max(peaks + [scale * first_peak]),
                                      4),
            "optimizer_s": round(opt_s, 4),
            "mfu_excl_optimizer": round(med([flops / max(s - opt_s, 1e-9) / 1e9 / p
                                             for s, p in zip(times, peaks)]), 4),
            "param_bytes_per_device": _device0_bytes(state.params),
            "opt_bytes_per_device": _device0_bytes(state.opt_state),
            "temp_bytes_per_device": temp}


def _optimizer_time(optimizer, state, hp, repeats: int) -> float:
    """Median time of the AdamW update alone (clip, moments, weight decay, apply) on the
    learner's sharded state with zero gradients: memory-bound work that grows with the
    parameter count, not the tokens of a step, so it is reported apart from the step."""
    def update(params, opt_state):
        grads = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        updates, opt_state = optimizer.update(grads, opt_state, params, hp)
        return ts.apply_updates(params, updates), opt_state
    fn = jax.jit(update, donate_argnums=(0, 1))
    params = jax.tree.map(jnp.copy, state.params)
    opt_state = jax.tree.map(jnp.copy, state.opt_state)
    params, opt_state = fn(params, opt_state)  # compile
    jax.block_until_ready(params)
    times = []
    for _ in range(max(repeats, 1)):
        t = time.perf_counter()
        params, opt_state = fn(params, opt_state)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _engine(ckpt: str, a, layout: str) -> JaxEngine:
    """The engine `bench_engine` times: `layout='paged'` is the paged KV cache (pages of 16, a
    pool of the dense cache's tokens, `engine.attention_kernel` = `--attention-kernel`)."""
    max_seq = a.prompt + a.decode_tokens
    config = {"max_slots": max(a.batches), "max_seq_len": max_seq, "dtype": a.dtype,
              "max_prefill_batch": max(a.batches), "prefill_buckets": (a.prompt,)}
    if layout == "paged":
        config.update(kv_layout="paged", page_size=min(16, max_seq),
                      attention_kernel=a.attention_kernel)
    return JaxEngine(ckpt, config)


def bench_engine(ckpt: str, cfg: ModelConfig, a, peaks: dict,
                 layouts: tuple = ("dense",)) -> dict:
    """Decode tokens/s at each batch against the rooflines, per layout of `layouts` (a
    result dict each, keyed by layout). All engines are built first and, per batch, timed
    interleaved: `a.repeats` rounds of one timed `generate` each, in `layouts` order, on the
    same prompts within a round; each reports the median over rounds (`round_tokens_per_s`
    lists them all). Interleaving keeps the ratio of two layouts honest on a machine whose
    load drifts (runs minutes apart moved it by more than the 8% it had to resolve, issue 25).
    The roofline is the same for every layout (each reads the same weights and live KV)."""
    engines = {}
    try:
        for layout in layouts:
            t = time.perf_counter()
            engines[layout] = _engine(ckpt, a, layout)
            progress(f"engine: {layout} engine built (checkpoint loaded) in "
                     f"{time.perf_counter() - t:.1f} s")
        eng0 = next(iter(engines.values()))
        wbytes = engine_memory.weight_bytes(cfg, eng0.dtype)
        kv_tok = engine_memory.kv_cache_bytes(cfg, 1, 1, eng0.dtype)
        out = {layout: {} for layout in layouts}
        rng = np.random.default_rng(1)
        for b in a.batches:
            def prompts(tag):
                return [GenerationRequest(f"{tag}-{i}", rng.integers(3, cfg.vocab_size, a.prompt)
                                          .astype(np.int32),
                                          SamplingParams(max_new_tokens=a.decode_tokens))
                        for i in range(b)]

            def run(engine, reqs):
                t = time.perf_counter()
                done = engine.generate(reqs)
                return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t)
            for layout, engine in engines.items():
                t = time.perf_counter()
                run(engine, prompts(f"warm{b}"))  # compile
                progress(f"engine: batch {b} {layout} warm-up (compile) "
                         f"{time.perf_counter() - t:.1f} s")
            rounds = {layout: [] for layout in layouts}
            for r in range(a.repeats):
                reqs = prompts(f"b{b}-r{r}")
                for layout, engine in engines.items():
                    rounds[layout].append(run(engine, reqs))
                    progress(f"engine: batch {b} {layout} round {r + 1}/{a.repeats} "
                             f"{rounds[layout][-1]:.1f} tokens/s")
            kv_read = b * kv_tok * (a.prompt + a.decode_tokens / 2)  # mean live KV a step
            bw_roof = b * peaks["copy_gbytes_s"] * 1e9 / (wbytes + kv_read)
            compute_roof = peaks["matmul_gflops"] * 1e9 / (2 * cfg.num_params)
            roof = min(bw_roof, compute_roof)
            for layout in layouts:
                tok_s = float(np.median(rounds[layout]))
                out[layout][f"batch_{b}"] = {
                    "tokens_per_s": round(tok_s, 1),
                    "round_tokens_per_s": [round(x, 1) for x in rounds[layout]],
                    "roofline_tokens_per_s": round(roof, 1),
                    "of_roofline": round(tok_s / roof, 4),
                    "bound": "memory" if bw_roof < compute_roof else "compute"}
        if "paged" in engines:
            out["paged"]["attention_impl"] = engines["paged"].attention_impl
    finally:
        for engine in engines.values():
            engine.close()
    return out


def paged_vs_dense(dense: dict, paged: dict) -> dict:
    """Per batch: the paged engine's share of the roofline over the dense engine's (the goal
    of issue 25: >= 1 at batch 32), as the median of the per-round ratios of an interleaved
    run (`bench_engine`; both share one roofline, so a share ratio is a tokens/s ratio)."""
    return {k: round(float(np.median(paged_vs_dense_rounds(dense, paged)[k])), 3)
            for k in dense if k.startswith("batch_")}


def paged_vs_dense_rounds(dense: dict, paged: dict) -> dict:
    """Per batch: each round's paged / dense tokens/s (the spread behind the median)."""
    return {k: [round(p / d, 3) for d, p in zip(dense[k]["round_tokens_per_s"],
                                                 paged[k]["round_tokens_per_s"])]
            for k in dense if k.startswith("batch_")}


def _sizes(a, cpu: bool) -> None:
    """Fills the unset sizes of `a` for the model and platform."""
    if a.smoke:
        sizes = dict(seqs=8, prompt=16, completion=16, micro_batches=2, steps=1,
                     batches="1,8", decode_tokens=8, matmul_n=256)
    elif cpu:
        sizes = dict(seqs=8, prompt=32, completion=96, micro_batches=2, steps=3,
                     batches="1,8,32", decode_tokens=32, matmul_n=2048)
    else:  # ~16k tokens a step: big enough to keep an accelerator busy
        sizes = dict(seqs=32, prompt=128, completion=384, micro_batches=2, steps=5,
                     batches="1,8,32", decode_tokens=128, matmul_n=8192)
    for k, v in sizes.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.batches = tuple(int(b) for b in str(a.batches).split(","))
    n = len(jax.devices())
    if a.mesh is not None:
        a.mesh = tuple(int(x) for x in str(a.mesh).split(","))
    else:
        a.mesh = (1, 4, 2) if cpu and n == N_DEVICES else (1, n, 1)
    if a.dtype == "auto":
        a.dtype = "float32" if cpu else "bfloat16"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="the tiny model, a few seconds")
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the learner's parameter (master weight) dtype")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype of learner and engine, and of the matmul peak "
                        "(auto: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--only", choices=("learner", "engine"), default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--checkpoint", default=None,
                   help="a random HF checkpoint of the benchmark's shape (e.g. from "
                        "python -m pipelinerl_jax.models.random_checkpoint); default: one "
                        "written host-side into --workdir, reused by a rerun")
    for k in ("seqs", "prompt", "completion", "micro_batches", "steps", "decode_tokens",
              "matmul_n"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--batches", default=None, help="engine decode batches, e.g. 1,8,32")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed engine rounds per batch (the median is reported; with "
                        "--kv-layout both each round times dense then paged)")
    p.add_argument("--kv-layout", default="dense", choices=("dense", "paged", "both"),
                   help="the engine's KV cache: 'both' builds both engines in one process and "
                        "times them interleaved (JSON keys engine, engine_paged, "
                        "paged_vs_dense_of_roofline: the median per-round ratio, "
                        "paged_vs_dense_rounds, paged_vs_dense_range)")
    p.add_argument("--attention-kernel", default="auto",
                   choices=("auto", "reference", "pallas"),
                   help="engine.attention_kernel of the paged engine")
    p.add_argument("--mesh", default=None,
                   help="learner mesh data,fsdp,tensor over the first devices, e.g. 1,1,1 "
                        "(default: 1,4,2 on CPU, every device on fsdp elsewhere)")
    a = p.parse_args()
    progress(f"started: jax {jax.__version__}, args {vars(a)}")
    cpu = jax.default_backend() == "cpu"
    _sizes(a, cpu)
    dev = jax.devices()[0]
    progress(f"backend ready: {len(jax.devices())} x {dev.platform} ({dev.device_kind})")
    shape = "tiny-qwen2" if a.smoke else "qwen2.5-0.5b"
    cfg = SHAPES[shape]()
    t = time.perf_counter()
    if a.checkpoint:
        ckpt = a.checkpoint
    else:  # written on the host with NumPy (no whole-model init to compile); a rerun reuses it
        workdir = a.workdir or tempfile.mkdtemp(prefix="bench_real_size_")
        ckpt = os.path.join(workdir, f"{shape}-random")
        if not os.path.exists(os.path.join(ckpt, "config.json")):
            write_random_checkpoint(cfg, ckpt, seed=0)
    check_checkpoint_shape(ckpt, cfg)  # a checkpoint of another shape is an error, not a run
    write_s = time.perf_counter() - t
    progress(f"checkpoint ready: {ckpt} ({'given' if a.checkpoint else 'written or reused'} "
             f"in {write_s:.1f} s)")
    peaks = measured_peaks(a.matmul_n, 10, dtype_of(a.dtype),
                           (64 if cpu else 1024) << 20)
    progress(f"peaks measured: {peaks['matmul_gflops']:.0f} GFLOP/s ({a.dtype} matmul), "
             f"{peaks['copy_gbytes_s']:.0f} GB/s copy")
    out = {"model": "tiny" if a.smoke else "qwen2.5-0.5b-shape", "params": cfg.num_params,
           "devices": f"{len(jax.devices())} x {dev.platform}",
           "device_kind": dev.device_kind, "jax": jax.__version__,
           "checkpoint": os.path.abspath(ckpt),
           "checkpoint_write_s": None if a.checkpoint else round(write_s, 1),
           "peaks": dict({k: round(v, 2) for k, v in peaks.items()}, matmul_dtype=a.dtype)}
    if a.only in (None, "learner"):
        out["learner"] = bench_learner(ckpt, cfg, a, peaks["matmul_gflops"])
        progress("learner: done")
    if a.only in (None, "engine"):
        layouts = ("dense", "paged") if a.kv_layout == "both" else (a.kv_layout,)
        try:  # a kernel that fails on this accelerator must not cost the other figures
            eng = bench_engine(ckpt, cfg, a, peaks, layouts)
        except Exception as e:  # noqa: BLE001 - reported in the JSON line
            if "paged" not in layouts:
                raise
            eng = {"paged": {"error": f"{type(e).__name__}: {str(e)[:1000]}"}}
            if "dense" in layouts:  # the dense figures alone, as before the paged engine
                eng.update(bench_engine(ckpt, cfg, a, peaks, ("dense",)))
        if "dense" in eng:
            out["engine"] = eng["dense"]
        if "paged" in eng:
            out["engine_paged"] = eng["paged"]
        if "dense" in eng and "paged" in eng and "error" not in eng["paged"]:
            out["paged_vs_dense_of_roofline"] = paged_vs_dense(eng["dense"], eng["paged"])
            rounds = paged_vs_dense_rounds(eng["dense"], eng["paged"])
            out["paged_vs_dense_rounds"] = rounds
            out["paged_vs_dense_range"] = {k: [min(v), max(v)] for k, v in rounds.items()}
        progress("engine: done")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
