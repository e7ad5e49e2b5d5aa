"""configs/default_lora.py end to end (real processes, real gRPC): the learner trains and
publishes only adapters, the rollout worker's JaxEngine merges each version, the evaluator
scores merged HF directories, and checkpoints hold no base weights."""
import os

import pytest

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
    assert sum(1 for x in leaves if x.ndim >= 2) == 3 * 2 * 7 * 2  # params, mu, nu
