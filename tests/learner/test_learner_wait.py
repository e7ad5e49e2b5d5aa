"""`run_learner` handed a scripted batch source and a fake clock: `learner/wait_time_s` is the
whole wait for a batch (every empty poll and queue outage since the previous step's work
ended), every `metrics.jsonl` row carries its absolute time, and each version is announced
with the lag limit decided when it was trained."""
import json
import time

import grpc
import numpy as np

from pipelinerl_jax.learner import loop
from pipelinerl_jax.models import save_pretrained
from pipelinerl_jax.models.factory import build_model
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport.queue_client import QueueUnavailable
from pipelinerl_jax.records import Rollout

PAUSE_S = 0.5  # what an empty poll or an outage costs on the fake clock (exact in binary)


class _Batch:
    def __init__(self, i, rollouts):
        self.batch_id, self.rollouts = f"b{i}", rollouts
        self.delivery_count, self.redelivered = 1, False


def _group(i, vocab):
    rng = np.random.default_rng(i)
    return [Rollout(prompt_ids=rng.integers(3, vocab, 4).astype(np.int32),
                    completion_ids=rng.integers(3, vocab, 6).astype(np.int32),
                    logp_behaviour=-rng.uniform(0.5, 2.0, 6).astype(np.float32),
                    version=np.zeros(6, np.int32), kv_version=np.zeros(6, np.int32),
                    reward=float(k), advantage=float(k) - 0.5, group_id=f"g-{i}",
                    group_size=2, finish_reason="stop", metrics={"correct": float(k)})
            for k in range(2)]


class _Clock:
    """Seconds that pass only when the fake queue says so: the learner's own work takes none."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _FakeQueue:
    """Step 1's batch comes after an empty poll and an outage, PAUSE_S each; step 2's at once.
    Records every announcement (version, lag limit)."""

    def __init__(self, vocab, clock):
        self.vocab, self.clock, self.calls = vocab, clock, 0
        self.script = ["empty", "down", "batch", "batch"]
        self.announced = []

    def get_batch(self, num_groups, timeout_s, learner_version=None, **announce):
        what = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if what == "empty":
            self.clock.now += PAUSE_S
            return None
        if what == "down":
            self.clock.now += PAUSE_S
            raise QueueUnavailable(grpc.StatusCode.UNAVAILABLE, "restarting")
        return _Batch(self.calls, _group(self.calls, self.vocab))

    def wait_ready(self, timeout):
        pass

    def set_version(self, version, **announce):
        self.announced.append((version, announce.get("max_lag")))
        return version

    def ack(self, batch_ids):
        return len(batch_ids)


class _Sink:
    def publish(self, version, params, policy_version=None):
        pass


def test_wait_time_counts_every_poll_and_each_version_announces_its_own_limit(tmp_path,
                                                                           monkeypatch):
    cfg = base_config()
    cfg.learner.total_steps, cfg.learner.batch_groups = 2, 1
    cfg.learner.checkpoint_every, cfg.learner.eval_every = 10, 0
    cfg.rollout.group_size = 2
    cfg.sampling.max_new_tokens, cfg.model.max_seq_len = 8, 16
    cfg.lag_control.enabled = True
    limits = iter([3, 1])  # the controller's limit after step 1, after step 2

    def update(self, metrics, arrays, wait_s=0.0, step_s=0.0):
        self.limit = next(limits)
        return {"lag_control/max_lag": self.limit}
    monkeypatch.setattr(loop.LagController, "update", update)
    tok = get_tokenizer(cfg.tokenizer)
    init = str(tmp_path / "init")
    save_pretrained(build_model(cfg.model, tok.vocab_size), init)
    clock = _Clock()
    queue = _FakeQueue(tok.vocab_size, clock)
    t_start = time.time()
    out = loop.run_learner(cfg, str(tmp_path / "run"), init, batches=queue, weight_sink=_Sink(),
                           clock=clock)
    assert out["step"] == 2
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first, second = [json.loads(line) for line in f]
    # Step 1 waited through an empty poll and an outage: both count (a clock restarted at
    # every poll would report only the last, instant one).
    assert first["learner/wait_time_s"] == 2 * PAUSE_S
    assert second["learner/wait_time_s"] == 0.0
    assert first["queue/unavailable_errors"] == 1
    assert first["wall_time_s"] == second["wall_time_s"] == 2 * PAUSE_S  # the same clock
    # Absolute time: within this test, and in step order.
    assert t_start <= first["time_unix"] <= second["time_unix"] <= time.time()
    # Every version, in order, with the limit decided when it was trained.
    assert queue.announced == [(0, cfg.max_lag), (1, 3), (2, 1)]
