"""Environments through the whole pipeline: the quick agent config's warm start, then a real
RolloutQueue server (gRPC), the real `RolloutWorker` over a real `JaxEngine` and the real
learner loop, in one process so the test sees both ends: every row the learner trained is
exactly the engine's tokens of each turn plus the calculator's reply tokens, mask 0 on the
replies; episodes that span a weight update carry each turn's versions through the wire; with
dynamic sampling, all-equal groups are dropped (counted) and every batch is still full."""
import importlib.util
import os
import threading

import numpy as np
import pytest

from pipelinerl_jax import run_config
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.envs import ModelTurn, build_task
from pipelinerl_jax.envs.calculator import CalculatorEnv
from pipelinerl_jax.launch.demonstrations import sft_on_demonstrations
from pipelinerl_jax.learner import loop as learner_loop
from pipelinerl_jax.metrics import read_metrics
from pipelinerl_jax.rollout.jax_engine import make_jax_engine
from pipelinerl_jax.rollout.worker import RolloutWorker
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer
from tests.envs.conftest import recording
from tests.envs.episode_checks import match_engine

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(name, arg=""):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


class InProcessSink:
    """The learner's weights straight into the worker (the stream sink's job)."""

    def __init__(self):
        self.worker, self.published = None, []

    def publish(self, version, params, policy_version=None):
        self.published.append(version)
        if self.worker is not None:
            self.worker.on_weights(WeightVersion("full").carrying(
                version, tensors=params, policy_version=policy_version))

    def close(self):
        pass


def test_agent_pipeline_trains_exactly_the_episodes(tmp_path, monkeypatch):
    cfg = load_config("agent_calculator.py", "quick")
    cfg.env.truncated_reward = -0.5  # the warm-started model's groups mix outcomes
    cfg.env.dynamic_sampling = True
    cfg.env.tool_latency_s = 0.1  # episodes long enough to span weight updates
    cfg.learner.total_steps = 5
    cfg.learner.eval_every = 0
    cfg.learner.checkpoint_every = 5
    cfg.engine.max_slots = 8
    cfg.resources.learner_cores = cfg.resources.sampler_cores = ""
    run_config.validate(cfg)
    cfg = run_config.resolve(cfg)
    workdir = str(tmp_path)
    init = sft_on_demonstrations(cfg, os.path.join(workdir, "warm_start"), progress=False)["checkpoint"]

    trained = []
    pack = learner_loop.batching.pack

    def capture(rollouts, version, **kw):  # what the learner trains, as it packs it
        out = pack(rollouts, version, **kw)
        trained.append((list(rollouts), out.arrays))
        return out
    monkeypatch.setattr(learner_loop.batching, "pack", capture)

    server = RolloutQueueServer.from_config(cfg.transport).start()
    cfg.transport.queue_port = int(server.address.rsplit(":", 1)[1])
    tok = get_tokenizer(cfg.tokenizer)
    engine = recording(make_jax_engine(cfg, init, 0, workdir))
    client = RolloutQueueClient(server.address)
    learner_queue = RolloutQueueClient(server.address)
    worker = RolloutWorker(cfg, engine, build_task(cfg), tok, client, workdir=workdir)
    sink = InProcessSink()
    sink.worker = worker
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        out = learner_loop.run_learner(cfg, workdir, init, batches=learner_queue,
                                       weight_sink=sink)
    finally:
        worker.stop()
        thread.join(60)
        worker.close()
        engine.close()
        client.close()
        learner_queue.close()
        server.stop(0)
    assert out["step"] == 5 and len(trained) == 5

    returned = {c.request_id: c for c in engine.returned}
    submitted = {r.request_id: r for r in engine.submitted}

    def reply(k, text):  # the calculator's answer to a tool call, computed on its own
        return CalculatorEnv(build_task(cfg), None).step(ModelTurn(0, np.zeros(0), text, ";",
                                                                   False)).text
    spanning = multi = 0
    G, B = cfg.rollout.group_size, cfg.learner.batch_groups
    for rollouts, arrays in trained:
        assert len(rollouts) == G * B  # every batch full
        groups = {}
        for row, r in enumerate(rollouts):
            groups.setdefault(r.group_id, []).append(r)
            c = len(r.completion_ids)
            # the packed row: every completion token is input, the mask is the episode's
            flat = arrays["input_ids"].reshape(-1)
            np.testing.assert_array_equal(flat[arrays["gather_idx"][0, row, :c] + 1],
                                          r.completion_ids)
            np.testing.assert_array_equal(arrays["loss_mask"][0, row, :c], r.loss_mask)
            assert arrays["loss_mask"][0, row, c:].sum() == 0
            match_engine(r, returned, submitted, env_reply=reply, tok=tok)
            model_versions = np.unique(r.version[r.loss_mask == 1])
            multi += int(r.turn_index[-1] > 0)
            spanning += int(model_versions.size > 1)
        assert len(groups) == B and all(len(g) == G for g in groups.values())
        assert all(len({r.reward for r in g}) > 1 for g in groups.values())  # none all-equal
    assert multi >= 4, multi
    assert spanning >= 1, "no trained episode spanned a weight update"
    assert worker.counts["groups_dropped_equal_rewards"] >= 1, dict(worker.counts)
    print(f"[agent pipeline] {sum(len(t[0]) for t in trained)} episodes trained, {multi} "
          f"multi-turn, {spanning} spanning a weight update; worker {dict(worker.counts)}")


def test_agent_kv_quick_config_runs_through_the_launcher(tmp_path):
    """`experiments/train.py --config=configs/agent_kv.py:quick` (shortened): warm start,
    queue, worker and learner processes; episode metrics, held-out episode success and the
    environment's counters land in the run's files, and every trained batch is whole."""
    import json
    import subprocess
    import sys
    workdir = tmp_path / "kv"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
           f"--config={os.path.join(ROOT, 'configs', 'agent_kv.py')}:quick",
           f"--workdir={workdir}", "--config.warm_start.steps=10",
           "--config.learner.total_steps=2", "--config.learner.eval_every=2",
           "--config.learner.eval_size=4", "--config.learner.checkpoint_every=2",
           "--config.resources.learner_cores=", "--config.resources.sampler_cores="]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]

    def rows(name):
        with open(workdir / name) as f:
            return [json.loads(line) for line in f if line.strip()]
    metrics = read_metrics(str(workdir))  # the evaluator's records merged in
    assert "eval/accuracy" in metrics[0] and "eval/turns_mean" in metrics[0]
    steps = [r for r in metrics if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "lag/turn_0/mean" in r and r["episode/turns_mean"] >= 1
        assert abs(sum(v for k, v in r.items() if k.startswith("episode/end_")) - 1) < 1e-6
    for b in rows("batches.jsonl"):
        assert b["num_groups"] == 2 and not b["incomplete_groups"]
    stats = rows("engine_stats.jsonl")
    assert stats and all("env" in s for s in stats)  # the runner's counters
    assert max(s["env"].get("episodes_started", 0) for s in stats) > 0
    samples = rows("samples.w0.jsonl")
    assert samples and all(s["turns"] >= 1 and s["end_reason"] for s in samples)
