"""A weight stream cut mid-version (the learner dies while shipping it): the rollout worker's
engine stays on its last complete version, bit for bit, keeps sampling with it, and takes the
next complete version once a publisher is back. (tests/transport shows the subscriber alone.)"""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipelinerl_jax.models import flat_params, from_pretrained
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.rollout.worker import RolloutWorker
from pipelinerl_jax.tasks import get_task
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer
from pipelinerl_jax.transport import weights
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.weights import WeightSubscriber
from pipelinerl_jax.records import GenerationRequest, SamplingParams
from tests.reliability.reliability_testlib import tiny_config, weights_publisher_main

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

CTX = mp.get_context("spawn")


def _eventually(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _probe(engine, tag):
    """Greedy completion of a fixed prompt: tokens and log-probs depend on the weights."""
    [c] = engine.generate([GenerationRequest(f"probe-{tag}", np.asarray([1, 5, 9, 3], np.int32),
                                             SamplingParams(max_new_tokens=8, temperature=0.0))])
    return c.token_ids.tolist(), c.logp_behaviour


def _start_publisher(files, port=0):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=weights_publisher_main,
                       args=(child, files, 1024, f"127.0.0.1:{port}"), daemon=True)
    proc.start()
    return proc, parent, parent.recv()


def test_cut_weight_stream_keeps_the_worker_on_its_last_complete_version(tmp_path, init_ckpt,
                                                                         monkeypatch):
    cfg = tiny_config()
    model = from_pretrained(init_ckpt)
    v1 = flat_params(model)
    rng = np.random.default_rng(0)
    v2 = {k: (a * 1.5 + rng.normal(0, 0.05, a.shape)).astype(a.dtype) for k, a in v1.items()}
    files = {1: str(tmp_path / "v1.safetensors"), 2: str(tmp_path / "v2.safetensors"),
             3: str(tmp_path / "v2.safetensors")}
    save_file(v1, files[1])
    save_file(v2, files[2])
    # A slow subscriber (2 ms per 1 KiB chunk) so that the kill lands mid-version.
    add = weights._Assembler.add
    monkeypatch.setattr(weights._Assembler, "add", lambda self, c: (time.sleep(0.002),
                                                                    add(self, c)))
    engine = JaxEngine(model, cfg.engine, version=-1, engine_id="jax-0", start=True)
    queue = RolloutQueueServer().start()
    client = RolloutQueueClient(queue.address)
    tok = get_tokenizer(cfg.tokenizer)
    worker = RolloutWorker(cfg, engine, get_task(cfg.task), tok, client, workdir=str(tmp_path))
    proc, conn, port = _start_publisher(files)
    sub = WeightSubscriber(f"127.0.0.1:{port}", worker.on_weights,
                           retry=RetryPolicy(initial_s=0.01, max_s=0.1))
    try:
        conn.send(1)
        conn.recv()
        _eventually(lambda: engine.version == 1)
        before = _probe(engine, "before")

        conn.send(2)  # version 2 streams in ~100 chunks; the publisher dies mid-way
        _eventually(lambda: sub.receiving[0] == 2 and sub.receiving[1] > 0)
        os.kill(proc.pid, signal.SIGKILL)
        _, got, total = sub.receiving
        proc.join(10)
        _eventually(lambda: sub.versions_discarded >= 1)
        assert got < total, "the whole version arrived before the kill"
        # Nothing of version 2 reached the engine: same version, same weights, same samples.
        assert engine.version == 1
        live = flat_params(engine.params)
        assert all(np.array_equal(live[k], v1[k]) for k in v1)
        tokens, logps = _probe(engine, "after-cut")
        assert tokens == before[0] and np.array_equal(logps, before[1])
        # The worker keeps sampling with version 1; every token it puts says so.
        client.set_version(1)
        worker.run(max_groups=4, max_seconds=60)
        assert worker.counts["groups_put"] >= 1
        batch = client.get_batch(worker.counts["groups_put"], timeout_s=10)
        assert all((r.version == 1).all() and r.start_version == 1 for r in batch.rollouts)

        # A publisher comes back on the same port (the restarted learner) with a complete
        # version: the engine takes it, and samples change with it.
        proc, conn, _ = _start_publisher(files, port)
        conn.send(3)
        conn.recv()
        _eventually(lambda: engine.version == 3)
        live = flat_params(engine.params)
        assert all(np.array_equal(live[k], v2[k]) for k in v2)
        assert not np.array_equal(_probe(engine, "v3")[1], before[1])
    finally:
        sub.close()
        engine.close()
        client.close()
        queue.stop(0)
        if proc.is_alive():
            proc.kill()
