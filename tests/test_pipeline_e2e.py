"""The real entry point end to end: queue server, rollout worker and learner processes,
gRPC on 127.0.0.1, orbax checkpoints, metrics, TensorBoard events and the plot."""
import glob
import os

import numpy as np
import pytest

from pipeline_testlib import make_init_checkpoint, read_jsonl, run_train

from pipelinerl_jax.learner.checkpoint import committed_steps
from pipelinerl_jax.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory):
    return make_init_checkpoint(str(tmp_path_factory.mktemp("init") / "model"))


@pytest.mark.parametrize("mode,max_lag", [("async", 2), ("sync", 0)])
def test_pipeline_runs_and_respects_max_lag(tmp_path, init_ckpt, mode, max_lag):
    workdir = tmp_path / mode
    run_train(workdir, f"--config.mode={mode}", f"--config.max_lag={max_lag}",
              f"--config.warm_start.checkpoint={init_ckpt}", "--config.learner.total_steps=4",
              "--config.learner.eval_every=4", "--config.learner.checkpoint_every=2")
    rows = read_jsonl(workdir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    # Versions advance one per step.
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["version"] for r in steps] == [1, 2, 3, 4]
    # No trained token is staler than max_lag (sync: none is stale at all).
    assert all(r["lag/max"] <= max_lag for r in steps)
    if mode == "sync":
        assert all(r["lag/mean"] == 0 and r["start_lag/mean"] == 0 for r in steps)
    # Every trained step carries the loss diagnostics, per lag bucket included.
    assert all("loss/ess" in r and "loss/lag_0/ess" in r for r in steps)
    # Held-out evaluation, by the evaluator role, of versions 0 and 4 (the last), merged into
    # the learner's rows of those steps.
    evals = read_jsonl(workdir / "eval.jsonl")
    assert [(r["step"], r["version"]) for r in evals] == [(0, 0), (4, 4)]
    merged = read_metrics(str(workdir))
    assert "eval/accuracy" in merged[0] and "eval/accuracy" in merged[-1]
    assert merged[-1]["step"] == 4 and "loss/ess" in merged[-1]
    assert "eval/accuracy" not in rows[0]  # the learner's own file holds its own rows
    # The engine received the published versions, in order, up to the last one it needed.
    received = [r["version"] for r in read_jsonl(workdir / "weights_received.w0.jsonl")]
    assert received == sorted(received) and received[0] == 0
    assert max(received) >= 3
    # Artifacts: checkpoints, TensorBoard events, plot, per-sample and engine logs.
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "committed_steps.json"]
    assert committed_steps(str(workdir / "checkpoints")) == [2, 4]
    assert glob.glob(str(workdir / "tb" / "events.out.tfevents.*"))
    assert glob.glob(str(workdir / "tb" / "events.out.tfevents.*.evaluator"))
    assert (workdir / "reward.png").stat().st_size > 5000
    samples = read_jsonl(workdir / "samples.w0.jsonl")
    assert samples and all(s["finish_reason"] in ("stop", "length") for s in samples)
    stats = read_jsonl(workdir / "engine_stats.jsonl")
    assert stats and all(0.0 <= s["occupancy"] <= 1.0 for s in stats)
    lags = np.concatenate([r["lag/hist"] for r in steps])
    assert lags.sum() > 0


def test_pipeline_with_sglang_samplers(tmp_path, init_ckpt):
    """`sampler.kind=sglang`: two SGLang test-server processes sample, a third serves the
    evaluator; the learner writes HF version directories and the servers are refit through
    /update_weights_from_disk."""
    from pipelinerl_jax.testing.sglang_process import ServerProcess
    shape = ('{"max_slots": 8, "max_seq_len": 32, "prefill_buckets": [32], '
             '"cache_buckets": [32], "max_prefill_batch": 2}')
    servers = [ServerProcess(["--model-path", init_ckpt, "--port", "0", "--weight-version",
                              "0", "--engine", shape], wait_ready=False) for _ in range(3)]
    try:
        for s in servers:
            s.wait_ready()
        urls = ",".join(f"'{s.url}'" for s in servers[:2])
        workdir = tmp_path / "sglang"
        run_train(workdir, "--config.sampler.kind=sglang", f"--config.sglang.urls=({urls},)",
                  f"--config.sglang.eval_urls=('{servers[2].url}',)",
                  f"--config.warm_start.checkpoint={init_ckpt}", "--config.max_lag=1",
                  "--config.learner.total_steps=3", "--config.learner.eval_every=2",
                  "--config.learner.checkpoint_every=3")
        steps = [r for r in read_jsonl(workdir / "metrics.jsonl") if r["step"] > 0]
        assert [r["version"] for r in steps] == [1, 2, 3]
        assert all(r["lag/max"] <= 1 for r in steps)
        # Versions reached the servers through /update_weights_from_disk.
        versions = [s.call("GET", "/get_weight_version")["weight_version"] for s in servers]
        assert all(int(v) >= 2 for v in versions[:2]), versions
        assert sorted(os.listdir(workdir / "weights"))[-1] == "v00000003"
        # Held-out evaluation sampled on the evaluator's own server, which loaded versions
        # 0, 2 and the last (3) from the learner's hand-over.
        assert [r["version"] for r in read_jsonl(workdir / "eval.jsonl")] == [0, 2, 3]
        assert int(versions[2]) == 3
    finally:
        for s in servers:
            s.kill()
