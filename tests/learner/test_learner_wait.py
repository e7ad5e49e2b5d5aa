"""`run_learner` against a fake queue: `learner/wait_time_s` is the whole wait for a batch
(every empty poll and queue outage since the previous step's work ended), and every
`metrics.jsonl` row carries its absolute time."""
import json
import time

import grpc
import numpy as np
import pytest

from pipelinerl_jax.learner import loop
from pipelinerl_jax.models import save_pretrained
from pipelinerl_jax.models.factory import build_model
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.tokenizers import get_tokenizer
from pipelinerl_jax.transport.queue_client import QueueUnavailable
from pipelinerl_jax.types import Rollout

PAUSE_S = 0.4


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


class _FakeQueue:
    """Step 1's batch comes after an empty poll and an outage, PAUSE_S each; step 2's at once."""

    def __init__(self, vocab):
        self.vocab, self.calls = vocab, 0
        self.script = ["empty", "down", "batch", "batch"]

    def __call__(self, *args, **kwargs):  # stands in for the RolloutQueueClient class
        return self

    def get_batch(self, num_groups, timeout_s, learner_version=None):
        what = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if what == "empty":
            time.sleep(PAUSE_S)
            return None
        if what == "down":
            time.sleep(PAUSE_S)
            raise QueueUnavailable(grpc.StatusCode.UNAVAILABLE, "restarting")
        return _Batch(self.calls, _group(self.calls, self.vocab))

    def wait_ready(self, timeout):
        pass

    def set_version(self, version):
        return version

    def ack(self, batch_ids):
        return len(batch_ids)

    def close(self):
        pass


class _Sink:
    def publish(self, version, params, policy_version=None):
        pass


def test_wait_time_counts_every_poll_since_the_last_step(tmp_path, monkeypatch):
    cfg = base_config()
    cfg.learner.total_steps, cfg.learner.batch_groups = 2, 1
    cfg.learner.checkpoint_every, cfg.learner.eval_every = 10, 0
    cfg.rollout.group_size = 2
    cfg.sampling.max_new_tokens, cfg.model.max_seq_len = 8, 16
    tok = get_tokenizer(cfg.tokenizer)
    init = str(tmp_path / "init")
    save_pretrained(build_model(cfg.model, tok.vocab_size), init)
    monkeypatch.setattr(loop, "RolloutQueueClient", _FakeQueue(tok.vocab_size))
    t_start = time.time()
    out = loop.run_learner(cfg, str(tmp_path / "run"), init, weight_sink=_Sink())
    assert out["step"] == 2
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    first, second = rows
    # Step 1 waited through an empty poll and an outage: both count (the old clock restarted
    # at every poll and reported only the last, instant one).
    assert first["learner/wait_time_s"] == pytest.approx(2 * PAUSE_S, abs=0.3)
    assert second["learner/wait_time_s"] < PAUSE_S
    assert first["queue/unavailable_errors"] == 1
    # Absolute time: within this test, and in step order.
    assert t_start <= first["time_unix"] <= second["time_unix"] <= time.time()
