"""A worker learns which of its groups the queue dropped and frees their batch places (a real
in-process queue, a scripted engine, the learner's calls made by hand). Before the fix every
drop shrank the worker's admission window by one group for good: after a learner rollback
(whose 'future' groups the queue drops) or a lowered limit the learner starved."""
import time

from pipelinerl_jax.rollout.worker import RolloutWorker
from pipelinerl_jax.run_config import base_config, resolve, validate
from pipelinerl_jax.tasks import get_task
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer
from tests.envs.scripted_engine import ScriptedEngine


def setup(max_lag, version):
    cfg = base_config()
    cfg.max_lag = max_lag
    cfg.rollout.group_size = 2
    cfg.learner.batch_groups = 2
    validate(cfg)
    cfg = resolve(cfg)
    tok = get_tokenizer(cfg.tokenizer)
    server = RolloutQueueServer(max_lag=max_lag).start()
    learner, producer = RolloutQueueClient(server.address), RolloutQueueClient(server.address)
    engine = ScriptedEngine(lambda req, i: [5, 6, tok.eos_id], vocab_size=tok.vocab_size,
                            max_seq_len=cfg.engine.max_seq_len, version=version)
    worker = RolloutWorker(cfg, engine, get_task(cfg.task), tok, producer)
    return server, learner, producer, engine, worker


def next_batch(worker, learner, version, deadline_s=6.0, **announce):
    """Runs the worker until the learner (at `version`) gets a batch; None if it starves."""
    end = time.time() + deadline_s
    while time.time() < end:
        worker.run(max_seconds=0.05)
        batch = learner.get_batch(2, timeout_s=0.05, learner_version=version, **announce)
        if batch is not None:
            learner.ack([batch.batch_id])
            return batch
    return None


def close(*things):
    for t in things:
        t.stop() if isinstance(t, RolloutQueueServer) else t.close()


def test_groups_dropped_after_a_learner_rollback_are_regenerated():
    """Regression: the learner at version 2 rolls back to 1; the worker's 4 groups for
    batches 2 and 3 (its whole window at max_lag 1) are dropped as 'future'. The old worker
    still counted them in batches 2 and 3, so after batch 1 it admitted nothing more and the
    learner starved at version 2."""
    server, learner, producer, engine, worker = setup(max_lag=1, version=2)
    try:
        learner.set_version(2)
        worker.run(max_groups=4, max_seconds=20)
        assert worker.counts["groups_put"] == 4  # batches 2 and 3: the whole window
        learner.set_version(1)  # a learner restarted from an older checkpoint
        engine.update_weights(None, 1, allow_older=True)
        for version in (1, 2, 3):
            batch = next_batch(worker, learner, version)
            assert batch is not None, f"learner starved at version {version}"
            assert all(r.version.max() <= version for r in batch.rollouts)
            engine.update_weights(None, version + 1)
        assert learner.stats()["dropped_groups"] == {"future": 4}
        assert worker.counts["groups_dropped_in_queue"] == 4
    finally:
        close(worker, learner, producer, server)


def test_worker_admits_under_a_lowered_limit_and_replaces_its_stale_groups():
    """Closed-loop control lowers the limit from 2 to 0: the worker's groups already put for
    batches 1 and 2 (version 0) are dropped as stale, replaced, and every later group starts
    at lag 0."""
    server, learner, producer, engine, worker = setup(max_lag=2, version=0)
    try:
        learner.set_version(0, max_lag=2)
        worker.run(max_groups=6, max_seconds=20)
        assert worker.counts["groups_put"] == 6 and worker.allowed_lag() == 2
        assert next_batch(worker, learner, 0, max_lag=2) is not None
        engine.update_weights(None, 1)
        learner.set_version(1, max_lag=0)
        for version in (1, 2, 3):
            batch = next_batch(worker, learner, version, max_lag=0)
            assert batch is not None, f"learner starved at version {version}"
            assert all((r.version == version).all() for r in batch.rollouts)  # lag 0
            engine.update_weights(None, version + 1)
        assert worker.allowed_lag() == 0
        assert worker.counts["groups_dropped_in_queue"] == 4
        assert learner.stats()["dropped_groups"] == {"stale": 4}
    finally:
        close(worker, learner, producer, server)
