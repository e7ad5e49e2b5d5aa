"""configs/default_lora.py end to end (real processes, real gRPC): the learner trains and
publishes only adapters, the rollout worker's JaxEngine merges each version, the evaluator
scores merged HF directories, and checkpoints hold no base weights."""
import os

import pytest

from pipelinerl_jax.learner.checkpoint import Checkpointer
from pipelinerl_jax.models.lora import base_identity

from pipelinerl_jax.metrics import read_metrics
from tests.pipeline_testlib import make_init_checkpoint, read_jsonl, run_train
from tests.reliability.reliability_testlib import checkpoint_state

pytestmark = pytest.mark.slow


def test_lora_pipeline_publishes_adapters_and_checkpoints_only_them(tmp_path):
    init = make_init_checkpoint(str(tmp_path / "init"))
    workdir = tmp_path / "run"
    run_train(workdir, f"--config.warm_start.checkpoint={init}",
              "--config.learner.total_steps=4", "--config.learner.eval_every=4",
              "--config.learner.checkpoint_every=2", "--config.lora.rank=2",
              config="default_lora.py")
    rows = read_jsonl(workdir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["version"] for r in steps] == [1, 2, 3, 4]
    assert all(r["learner/skipped_steps"] == 0 for r in steps)
    received = [r["version"] for r in read_jsonl(workdir / "weights_received.w0.jsonl")]
    assert received[0] == 0 and max(received) >= 3
    evals = read_jsonl(workdir / "eval.jsonl")
    assert [(r["step"], r["version"]) for r in evals] == [(0, 0), (4, 4)]
    assert "eval/accuracy" in read_metrics(str(workdir))[-1]
    # adapters (A and B of 7 projections x 2 layers), their AdamW moments, counters; the
    # tiny model's largest adapter is [64, 2] or [2, 64], every base matrix is larger
    leaves = checkpoint_state(str(workdir), 4)
    assert max(x.size for x in leaves) == 64 * 2
    # ... and name the base they belong to
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    meta = ckpt.read_state(4)[1]
    ckpt.close()
    assert meta["lora_base"] == base_identity(str(tmp_path / "init"))
    assert sum(1 for x in leaves if x.ndim >= 2) == 3 * 2 * 7 * 2  # params, mu, nu

    # A restart over another base is refused, naming both; over the same base it resumes.
    other = make_init_checkpoint(str(tmp_path / "other"), seed=1)
    out = run_train(workdir, f"--config.warm_start.checkpoint={other}",
                    "--config.learner.total_steps=6", "--config.learner.eval_every=4",
                    "--config.learner.checkpoint_every=2", "--config.lora.rank=2",
                    "--config.launch.max_learner_restarts=0",
                    config="default_lora.py", check=False)
    logs = "".join(open(p).read() for p in (workdir / "logs").glob("*"))
    assert out.returncode != 0
    assert "holds LoRA adapters of the base" in logs + out.stderr
    run_train(workdir, f"--config.warm_start.checkpoint={init}",
              "--config.learner.total_steps=6", "--config.learner.eval_every=4",
              "--config.learner.checkpoint_every=2", "--config.lora.rank=2",
              config="default_lora.py")
    steps = [r for r in read_jsonl(workdir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps][-2:] == [5, 6]


def test_lora_pipeline_with_sglang_samplers_loads_an_adapter_per_version(tmp_path):
    """`sampler.kind=sglang` with LoRA: the learner writes a PEFT directory per version, the
    workers' servers load each (`/load_lora_adapter`, test servers with --enable-lora and
    --stub) and every request names the newest; the evaluator's server receives the adapters
    too (the run's one weight message), loading each evaluated version's PEFT directory."""
    import json

    from pipelinerl_jax.testing.sglang_process import ServerProcess
    init = make_init_checkpoint(str(tmp_path / "init"))
    lora_args = ["--stub", "--model-path", init, "--port", "0", "--enable-lora",
                 "--max-lora-rank", "2", "--lora-target-modules", "all"]
    servers = [ServerProcess(lora_args, wait_ready=False) for _ in range(3)]
    try:
        for s in servers:
            s.wait_ready()
        urls = ",".join(f"'{s.url}'" for s in servers[:2])
        workdir = tmp_path / "run"
        run_train(workdir, "--config.sampler.kind=sglang", f"--config.sglang.urls=({urls},)",
                  f"--config.sglang.eval_urls=('{servers[2].url}',)",
                  f"--config.warm_start.checkpoint={init}", "--config.max_lag=1",
                  "--config.learner.total_steps=3", "--config.learner.eval_every=2",
                  "--config.learner.checkpoint_every=3", "--config.lora.rank=2",
                  config="default_lora.py")
        steps = [r for r in read_jsonl(workdir / "metrics.jsonl") if r["step"] > 0]
        assert [r["version"] for r in steps] == [1, 2, 3]
        assert all(r["lag/max"] <= 1 for r in steps)
        last = sorted(os.listdir(workdir / "weights"))[-1]
        assert last == "v00000003"
        config = json.load(open(workdir / "weights" / last / "adapter_config.json"))
        assert config["r"] == 2 and config["peft_type"] == "LORA"
        for s in servers[:2]:
            stats = s.stats()
            assert stats["lora_counts"]["load_lora_adapter"] >= 2  # a version loaded each time
            assert len(stats["lora_loaded"]) <= 2  # old ones unloaded
            named = {r["lora_path"] for r in s.record()}
            assert named and all(n is None or n.startswith("v") for n in named)
        assert any(r["lora_path"] for s in servers[:2] for r in s.record())
        assert [r["version"] for r in read_jsonl(workdir / "eval.jsonl")] == [0, 2, 3]
        evaluated = servers[2].stats()["lora_counts"]["load_lora_adapter"]
        assert evaluated == 3  # versions 0, 2, 3: adapters, not a merged base
    finally:
        for s in servers:
            s.kill()
