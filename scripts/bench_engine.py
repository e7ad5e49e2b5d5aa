"""Decode throughput of JaxEngine vs Hugging Face `generate` (and Tunix's sampler if present),
plus continuous vs static batching under a long-tailed request stream.

    PYTHONPATH=. python scripts/bench_engine.py                 # full run (~10 min on 2 cores)
    PYTHONPATH=. python scripts/bench_engine.py --quick         # tiny model only, small sizes

Throughput = batch × new tokens / wall time of generating them (prefill included, the same
for every engine): B prompts of `prompt_len` random tokens, exactly `new_tokens` new tokens
each (no stop token), greedy decoding, float32, the same weights everywhere (our model is
written with `save_pretrained` and read back by `AutoModelForCausalLM.from_pretrained`).
Every engine gets one untimed warm-up call of the same shape first (JAX compiles, torch
allocates). torch uses as many threads as XLA's CPU client (all cores).

Straggler section: R requests with max_new_tokens ~ lognormal, served by one engine with S
slots (continuous batching: a finished sample's slot is refilled at once) vs the same engine
fed static batches of S requests (each batch waits for its slowest sample). Slot occupancy =
busy slot-steps / (decode steps × S).

Prints one JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from pipelinerl_jax.models import Decoder, config_100m, save_pretrained, tiny_config
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.records import GenerationRequest, SamplingParams

TUNIX_PYTHON = "/tmp/tunix-venv/bin/python"
STRAGGLER_MODEL = tiny_config(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                              num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)


def prompts(batch, prompt_len, vocab, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, (batch, prompt_len)).astype(np.int32)


def bench_jax(model, batch, prompt_len, new_tokens, steps_per_sync, repeats):
    eng = JaxEngine(model, dict(max_slots=batch, max_seq_len=prompt_len + new_tokens,
                                prefill_buckets=(prompt_len,), max_prefill_batch=batch,
                                steps_per_sync=steps_per_sync))

    def run(tag):
        ids = prompts(batch, prompt_len, model.cfg.vocab_size, seed=len(tag))
        reqs = [GenerationRequest(f"{tag}{i}", ids[i],
                                  SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
                for i in range(batch)]
        t = time.perf_counter()
        out = eng.generate(reqs)
        dt = time.perf_counter() - t
        assert all(len(c.token_ids) == new_tokens for c in out)
        return dt
    run("warm")
    dt = min(run("t" * (i + 1)) for i in range(repeats))
    eng.close()
    return batch * new_tokens / dt


def bench_hf(path, batch, prompt_len, new_tokens, vocab, threads, repeats):
    import torch
    import transformers
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(seed, n):
        ids = torch.from_numpy(prompts(batch, prompt_len, vocab, seed).astype(np.int64))
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, use_cache=True,
                                 pad_token_id=0)
        dt = time.perf_counter() - t
        assert out.shape[1] == prompt_len + n
        return dt
    run(4, min(new_tokens, 4))
    dt = min(run(i, new_tokens) for i in range(repeats))
    return batch * new_tokens / dt


def bench_tunix(path, batch, prompt_len, new_tokens, repeats):
    """Runs Tunix's sampler in its own virtualenv (this script's --tunix-worker mode);
    returns (tok/s, "") or (None, one-line reason)."""
    if not os.path.exists(TUNIX_PYTHON):
        venv = os.path.dirname(os.path.dirname(TUNIX_PYTHON))
        return None, (f"no Tunix venv at {venv} (python -m venv --system-site-packages "
                      f"{venv} && {venv}/bin/pip install google-tunix)")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))}
    try:
        res = subprocess.run([TUNIX_PYTHON, os.path.abspath(__file__), "--tunix-worker", path,
                              str(batch), str(prompt_len), str(new_tokens), str(repeats)],
                             capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return None, "Tunix sampler timed out"
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode or not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"Tunix sampler failed: {tail[0][:200]}"
    return json.loads(lines[-1])["tok_s"], ""


def tunix_worker(path, batch, prompt_len, new_tokens, repeats):
    """Greedy generation with `tunix.generate.sampler.Sampler` on the same checkpoint (Tunix's
    Llama-3 model loaded from our safetensors; prompts travel as strings of token ids)."""
    import jax
    import jax.numpy as jnp
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.llama3 import model as tunix_llama
    from tunix.models.llama3 import params as tunix_params
    hf = json.load(open(os.path.join(path, "config.json")))
    cfg = tunix_llama.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"], weight_tying=hf["tie_word_embeddings"],
        shd_config=tunix_llama.ShardingConfig.get_default_sharding(is_sampling=True))
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = tunix_params.create_model_from_safe_tensors(path, cfg, mesh, dtype=jnp.float32)

    class IdTokenizer:  # "3 17 5" <-> [3, 17, 5]
        def encode(self, text, **kw):
            return [int(t) for t in text.split()]

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

        def bos_id(self):
            return 0

        def eos_id(self):
            return hf["vocab_size"]  # never sampled: every row runs all new tokens

        def pad_id(self):
            return 0
    sampler = tunix_sampler.Sampler(model, IdTokenizer(), tunix_sampler.CacheConfig(
        cache_size=prompt_len + new_tokens, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))

    def run(seed):
        ids = prompts(batch, prompt_len, hf["vocab_size"], seed)
        strings = [" ".join(map(str, row)) for row in ids]
        t = time.perf_counter()
        out = sampler(strings, max_generation_steps=new_tokens, max_prompt_length=prompt_len,
                      temperature=0.0, eos_tokens=[hf["vocab_size"]])
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t
    run(0)
    dt = min(run(i + 1) for i in range(repeats))
    print(json.dumps({"tok_s": batch * new_tokens / dt}))


def straggler(model, num_requests, slots, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.maximum(rng.lognormal(3.3, 0.9, num_requests), 1), 200).astype(int)
    ids = prompts(num_requests, 8, model.cfg.vocab_size, seed)
    eng = JaxEngine(model, dict(max_slots=slots, max_seq_len=256, prefill_buckets=(16,),
                                max_prefill_batch=slots))
    eng.warmup()

    def reqs(tag):
        return [GenerationRequest(f"{tag}{i}", ids[i],
                                  SamplingParams(max_new_tokens=int(lengths[i]), seed=i))
                for i in range(num_requests)]
    out = {}
    for mode in ("continuous", "static"):
        eng.stats()
        t = time.perf_counter()
        if mode == "continuous":
            eng.generate(reqs("c"))
        else:
            rs = reqs("s")
            for i in range(0, num_requests, slots):
                eng.generate(rs[i:i + slots])
        dt = time.perf_counter() - t
        st = eng.stats()
        out[mode] = {"wall_s": round(dt, 3), "tok_s": round(int(lengths.sum()) / dt, 1),
                     "slot_occupancy": round(st["slot_occupancy"], 3),
                     "decode_steps": st["window_decode_steps"]}
    eng.close()
    out.update(model_params_m=round(model.cfg.num_params / 1e6, 1), requests=num_requests,
               slots=slots, total_new_tokens=int(lengths.sum()),
               max_new_tokens_p50=int(np.median(lengths)), max_new_tokens_max=int(lengths.max()),
               speedup=round(out["static"]["wall_s"] / out["continuous"]["wall_s"], 2))
    return out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--tunix-worker":
        path, b, p, n, r = sys.argv[2], *map(int, sys.argv[3:7])
        return tunix_worker(path, b, p, n, r)
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model, small sizes")
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--batches-100m", default="1,8,32,128")
    ap.add_argument("--peers", default="hf,tunix")
    ap.add_argument("--steps-per-sync", type=int, default=16)
    args = ap.parse_args()
    import jax
    from flax import nnx
    threads = os.cpu_count()
    models = ["tiny"] if args.quick else args.models.split(",")
    peers = args.peers.split(",") if args.peers else []
    rows = []
    notes = {}
    for name in models:
        if name == "tiny":
            cfg, prompt_len, new_tokens, repeats = tiny_config(), 32, 224, 2
            batches = [int(b) for b in args.batches.split(",")]
        else:
            cfg, prompt_len, new_tokens, repeats = config_100m(), 32, 128, 1
            batches = [int(b) for b in args.batches_100m.split(",")]
        if args.quick:
            new_tokens = 32
        model = Decoder(cfg, nnx.Rngs(0))
        path = tempfile.mkdtemp(prefix=f"bench_engine_{name}_")
        save_pretrained(model, path)
        for b in batches:
            n = new_tokens
            if name == "100m" and (b == 1 or b >= 128):  # keep the whole run near 10 minutes
                n = new_tokens // 2 if b == 1 else new_tokens // 8
            row = {"model": name, "params_m": round(cfg.num_params / 1e6, 2), "batch": b,
                   "prompt_len": prompt_len, "new_tokens": n}
            row["jax_engine_tok_s"] = round(bench_jax(model, b, prompt_len, n,
                                                      args.steps_per_sync, repeats), 1)
            if "hf" in peers:
                row["hf_tok_s"] = round(bench_hf(path, b, prompt_len, n, cfg.vocab_size,
                                                 threads, repeats), 1)
            if "tunix" in peers:
                tok_s, why = bench_tunix(path, b, prompt_len, n, repeats)
                row["tunix_tok_s"] = None if tok_s is None else round(tok_s, 1)
                if why:
                    notes["tunix"] = why
            best = max([row.get(k) or 0 for k in ("hf_tok_s", "tunix_tok_s")])
            row["speedup_vs_best_peer"] = round(row["jax_engine_tok_s"] / best, 2) if best else None
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    # A ~15M-parameter model: big enough that a decode step's compute, not host overhead,
    # sets the pace (as on an accelerator with a real model).
    small = Decoder(tiny_config() if args.quick else STRAGGLER_MODEL, nnx.Rngs(0))
    strag = straggler(small, 48 if args.quick else 128, 16)
    print(json.dumps({"straggler": strag}), file=sys.stderr, flush=True)
    print(json.dumps({
        "bench": "engine", "backend": jax.default_backend(), "cpu_threads": threads,
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores",
        "metric": "new tokens/s, greedy, float32, prefill included", "results": rows,
        "straggler": strag, "notes": notes}))


if __name__ == "__main__":
    main()
