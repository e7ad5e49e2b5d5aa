"""Every program of a run compiles for a TPU topology on this CPU host (libtpu's compiler):
the default config's programs on `v5e:2x2`, and Qwen2.5-0.5B's engine decode with the
Pallas kernel per shard of a 2-way tensor mesh, whose HLO must call the Mosaic kernel."""
import json
import os
import subprocess
import sys

import jax
import pytest

from configs import default
from pipelinerl_jax.aot import check, programs, report
from pipelinerl_jax.aot.chips import CHIPS
from pipelinerl_jax.models.hf_io import load_config
from pipelinerl_jax.rollout.engine_programs import engine_mesh, engine_programs
from pipelinerl_jax.rollout.jax_engine import engine_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_default_config_programs_compile_and_fit_a_v5e(v5e_2x2, tmp_path):
    """The quick check (`--fast`: what it asserts here does not depend on the plan; the
    full plan's train step alone compiles for ~1 minute: the slow test below compares)."""
    cfg = default.get_config()
    cfg.engine.dtype = "bfloat16"  # a TPU engine's: the float32 learner publishes bf16
    summary = report.run(cfg, "v5e:2x2", dump_dir=str(tmp_path), fast=True,
                         log=lambda *a: None)
    progs = summary["programs"]
    # the Pallas decode compiles once, at the largest attention bucket: the kernel's costs do
    # not depend on the length (the smallest bucket's point is derived, below)
    assert sorted(progs) == ["engine/decode[rows=64,len=256]", "engine/prefill[b=4,t=256]",
                             "engine/reshard", "learner/publish", "learner/train_step"]
    assert summary["failures"] == []
    for name, p in progs.items():
        assert p["compiled"] and p["fits"], (name, p.get("error"))
        assert 0 < p["hbm_bytes_per_chip"] <= p["hbm_capacity_bytes"] == 16e9, name
        assert p["bytes_accessed"] > 0 and p["roofline_s"] > 0, name
    # the compiler's FLOPs of a train step: at least forward + backward (3 forwards) of
    # every packed token through the model's matmuls
    mc = programs.model_config(cfg)
    train = progs["learner/train_step"]
    forward = mc.flops_per_token(0) * train["work"]["tokens"]
    assert 3 * forward <= train["flops"] <= 6 * forward
    # a decode step of 64 rows: their forward, counted once per step (the while body)
    decode = progs["engine/decode[rows=64,len=256]"]
    assert mc.flops_per_token(0) * 64 <= decode["flops"] <= 2 * mc.flops_per_token(256) * 64
    # the paged decode attention is the Pallas TPU kernel (a Mosaic custom call a layer)
    assert decode["mosaic_calls"] == mc.num_layers
    hlo = (tmp_path / "engine_decode_rows=64,len=256_.hlo.txt").read_text()
    assert 'custom_call_target="tpu_custom_call"' in hlo
    # the published snapshot: the params in bf16 (2 bytes each, on the learner's one chip;
    # XLA:TPU pads small arrays to its tiles, a fraction of a percent here), live beside the
    # whole train step
    pub = progs["learner/publish"]
    bf16_bytes = 2 * pub["work"]["params"]
    assert pub["chips"] == 1 and pub["work"]["dtype"] == "bfloat16"
    assert bf16_bytes <= pub["memory"]["outputs"] <= 1.01 * bf16_bytes
    assert pub["memory"]["alongside"] == train["hbm_bytes_per_chip"]
    assert pub["hbm_bytes_per_chip"] == train["hbm_bytes_per_chip"] + pub["memory"]["outputs"]
    # the engine's weight update reads that bf16 (its arguments: the params in 2 bytes)
    assert bf16_bytes <= progs["engine/reshard"]["memory"]["arguments"] <= 1.01 * bf16_bytes
    est = summary["estimates"]
    assert est["train_step_s"] == train["roofline_s"] * train["work"]["chunks"]
    # XLA counts the Mosaic kernel's traffic from its own context-free estimate: the KV pool
    # reads (64 rows x the bucket's positions x every layer's K and V of the chip's heads, at
    # least the model's unpadded ones in bf16) are added, so a longer bucket costs more
    kv = decode["work"]["kernel_kv_bytes"]
    assert kv >= 64 * 256 * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    costs = {d["cache_len"]: d for d in est["sim_costs"]["decode"]}
    assert sorted(costs) == [64, 256]
    for length in (64, 256):
        assert costs[length]["kv_bytes_added"] == kv * length / 256
        assert costs[length]["bytes_accessed"] == decode["bytes_accessed"] + kv * length / 256
        assert costs[length]["flops"] == decode["flops"]
    assert costs[256]["step_s"] > costs[64]["step_s"]
    roofline = CHIPS["v5e"].roofline_s(decode["flops"], costs[256]["bytes_accessed"])
    assert est["decode_tokens_per_s_per_chip"] == pytest.approx(64 / roofline)
    assert summary["plan"] == "quick" and progs["learner/train_step"]["plan"] == "quick"


@pytest.mark.slow  # the full plan of the train step alone is ~1 minute here
def test_the_quick_check_keeps_the_programs_buffers_and_flops_of_the_full_one(v5e_2x2):
    """`--fast` against the full plan (the verdict): the same programs, the same buffers in
    and out (shapes and shardings are the program's), the same FLOPs and kernel calls, the
    decode identical (it keeps the full plan), and another plan elsewhere (the option reaches
    the compiler: some program's temporaries or code differ)."""
    cfg = default.get_config()
    cfg.engine.dtype = "bfloat16"
    full = report.run(cfg, "v5e:2x2", log=lambda *a: None)
    lines = []
    quick = report.run(cfg, "v5e:2x2", fast=True, log=lines.append)
    assert full["plan"] == "full" and quick["plan"] == "quick"
    assert lines[0].startswith("quick check")
    progs = full["programs"]
    assert sorted(quick["programs"]) == sorted(progs) and quick["failures"] == []
    for name, p in progs.items():
        q = quick["programs"][name]
        assert q["compiled"] and q["fits"] and p["fits"], name
        for part in ("arguments", "outputs", "aliased"):
            assert q["memory"].get(part) == p["memory"].get(part), (name, part)
        assert q["flops"] == pytest.approx(p["flops"], rel=0.01), name
        assert q["mosaic_calls"] == p["mosaic_calls"], name
    assert any(quick["programs"][n]["memory"] != p["memory"] for n, p in progs.items())
    name = "engine/decode[rows=64,len=256]"
    assert {**quick["programs"][name], "compile_s": 0} == {**progs[name], "compile_s": 0}
    assert quick["programs"]["learner/train_step"]["plan"] == "quick"


@pytest.mark.slow  # a real-size (0.5B) compile, 24 s: the fast tier has the tiny model's
# (tests/rollout/test_engine_programs_tpu.py)
def test_qwen_05b_decode_runs_the_pallas_kernel_per_shard_of_a_2way_tensor_mesh(v5e_2x2):
    devices, _ = v5e_2x2
    mc = load_config(os.path.join(ROOT, "configs", "shapes", "qwen2.5-0.5b"))
    e = engine_config()
    e.update(kv_layout="paged", attention_kernel="pallas", dtype="bfloat16", max_slots=32,
             max_seq_len=1024, kv_budget_tokens=32 * 1024, tensor_parallel=2)
    mesh = engine_mesh(2, devices[:2])
    progs = engine_programs(mc, e, mesh, block_sizes=programs.block_sizes(e))
    with programs.default_device(devices):
        compiled = progs.fns.decode.lower(*progs.decode_args(32), cache_len=1024,
                                          rows=32).compile()
    assert check.mosaic_calls(compiled.as_text()) == mc.num_layers
    # weights and pool are split over the two chips: each holds about half of them
    whole = sum(x.size * x.dtype.itemsize
                for x in jax.tree.leaves((progs.params, progs.cache)))
    per_chip = check.memory_of(compiled)["arguments"]
    assert 0.45 * whole < per_chip < 0.6 * whole


@pytest.mark.slow  # starts the entry point
def test_a_program_that_does_not_fit_fails_the_command_naming_the_key(v5e_2x2, tmp_path):
    out = tmp_path / "check.json"
    # 20M tokens of the default model's KV (1 KiB a token) are 20 GiB: no v5e holds them
    proc = subprocess.run(
        [sys.executable, "experiments/compile_check.py", "--config=configs/default.py",
         "--topology=v5e:2x2", "--roles=sampler", "--config.engine.kv_budget_tokens=20000000",
         f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "FAIL: engine/decode[rows=64,len=256] needs" in proc.stdout
    assert "change engine.kv_budget_tokens" in proc.stdout
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary
    decode = summary["programs"]["engine/decode[rows=64,len=256]"]
    # XLA:TPU itself refuses to compile it, naming what it needs: the check reports that
    assert decode["out_of_memory"] and not decode["compiled"] and not decode["fits"]
    assert decode["hbm_bytes_per_chip"] > decode["hbm_capacity_bytes"]


@pytest.mark.slow  # starts the entry point
def test_a_bad_config_fails_before_compiling_naming_the_key():
    proc = subprocess.run(
        [sys.executable, "experiments/compile_check.py", "--config=configs/default.py",
         "--topology=v5e:2x2", "--config.learner.micro_batches=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "config error: learner.batch_groups" in proc.stderr
    assert "compiling" not in proc.stdout


def test_a_lora_runs_engine_serves_adapters_and_a_version_moves_only_them(v5e_2x2):
    """The LoRA engine's programs carry the adapters (served unmerged), and its weight update
    moves the adapters alone (the engine keeps its base): counted independently from the
    model's shape, every projection adapted."""
    cfg = default.get_config()
    cfg.lora.enabled, cfg.engine.dtype = True, "bfloat16"
    summary = report.run(cfg, "v5e:2x2", roles=("sampler",), fast=True, log=lambda *a: None)
    assert summary["failures"] == []
    progs = summary["programs"]
    mc = programs.model_config(cfg)
    r = cfg.lora.rank
    D, I, X = mc.hidden_size, mc.intermediate_size, mc.head_dim
    H, K = mc.num_heads, mc.num_kv_heads
    # q, k, v, o, gate, up, down: A is in x r, B is r x out
    per_layer = r * (7 * D + 2 * H * X + 2 * K * X + 3 * I)
    reshard = progs["engine/reshard"]
    assert reshard["work"]["kind"] == "lora adapters"
    assert reshard["work"]["params"] == per_layer * mc.num_layers
    assert reshard["memory"]["outputs"] < 4 * per_layer * mc.num_layers  # bf16, padded
    # the decode holds the base and the adapters: more than the base alone
    plain = default.get_config()
    plain.engine.dtype = "bfloat16"
    base = report.run(plain, "v5e:2x2", roles=("sampler",), fast=True,
                      log=lambda *a: None)["programs"]
    name = next(k for k in progs if k.startswith("engine/decode"))
    grown = progs[name]["memory"]["arguments"] - base[name]["memory"]["arguments"]
    assert grown >= 2 * per_layer * mc.num_layers
    assert base["engine/reshard"]["work"]["kind"] == "full"
