"""Multi-turn episodes through `SGLangEngine` against the protocol-faithful test server (a
child process generating with a real JaxEngine): every turn is a `/generate` on `input_ids`,
the episode is token-exact, and each model token's log-prob is the learner's recompute on the
episode's sequence; the same through the rollout worker and the queue."""
import pytest

from pipelinerl_jax.envs import EpisodeRunner
from pipelinerl_jax.models import save_pretrained
from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.rollout.worker import RolloutWorker
from pipelinerl_jax.run_config import base_config, resolve
from pipelinerl_jax.testing.sglang_process import ServerProcess
from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer
from tests.envs.conftest import (RANDOM_MODEL_STOPS, ToyTask, check_logps, check_token_exact,
                                 recording, toy_problem)
from tests.envs.episode_checks import match_engine
from tests.rollout.conftest import full_logits, make_model, reference  # noqa: F401

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

SHAPE = '{"max_slots": 4, "max_seq_len": 48, "prefill_buckets": [48], "cache_buckets": [48], ' \
        '"max_prefill_batch": 1, "steps_per_sync": 4}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(100)
    path = str(tmp_path_factory.mktemp("sglang") / "v0")
    save_pretrained(model, path)
    proc = ServerProcess(["--model-path", path, "--port", "0", "--weight-version", "0",
                          "--kv-policy", "keep", "--engine", SHAPE])
    try:
        yield proc, model
    finally:
        proc.kill()


def test_multi_turn_episodes_through_sglang(tok, server, reference):  # noqa: F811
    proc, model = server
    eng = recording(SGLangEngine([proc.url], dict(health_deadline_s=60.0), vocab_size=64,
                                 max_seq_len=48))
    runner = EpisodeRunner(eng, tok, ToyTask(), max_turn_tokens=10,
                           stop_token_ids=RANDOM_MODEL_STOPS, tool_threads=4)
    try:
        eps = runner.run([toy_problem(i, turns=3) for i in range(6)], seeds=list(range(6)),
                         timeout=300)
    finally:
        runner.close()
        eng.close()
    multi = [e for e in eps if len(e.turns) >= 2]
    assert len(multi) >= 2, [e.end_reason for e in eps]
    for ep in eps:
        assert ep.status in ("done", "truncated"), ep.detail
        check_token_exact(ep, eng, tok, env_texts=["=0\n", "=1\n"])
    for ep in multi:
        check_logps(ep, model, reference, turns=list(range(len(ep.turns))))


class ToyWithRandomModelStops(ToyTask):
    """Toy episodes of 3 turns over varied prompts, turns ended by the ids the random test
    model samples most (so that its turns end by a stop and episodes go multi-turn)."""

    def _generate(self, rng):
        return "".join(rng.choice(list("abcdef"), 3)) + "=", "x", {"turns": 3}

    def stop_token_ids(self, tokenizer):
        return RANDOM_MODEL_STOPS


def test_worker_runs_multi_turn_groups_through_sglang(tok, server, reference):  # noqa: F811
    """The rollout worker in environment mode over `SGLangEngine`: groups of multi-turn
    episodes reach the queue token-exact, masks right, log-probs the learner's recompute."""
    proc, model = server
    cfg = base_config()
    cfg.task.name = "calculator"  # any environment: the worker plays the task it is given
    cfg.env.max_turn_tokens, cfg.env.max_episode_tokens = 10, 48
    cfg.model.max_seq_len = 48
    cfg.rollout.group_size, cfg.learner.batch_groups = 2, 2
    cfg = resolve(cfg)
    queue = RolloutQueueServer().start()
    client = RolloutQueueClient(queue.address)
    eng = recording(SGLangEngine([proc.url], dict(health_deadline_s=60.0), vocab_size=64,
                                 max_seq_len=48))
    worker = RolloutWorker(cfg, eng, ToyWithRandomModelStops(), tok, client)
    try:
        assert eng.version == 0
        client.set_version(0)
        worker.run(max_groups=4, max_seconds=240)
        batch = client.get_batch(4, timeout_s=30)
    finally:
        worker.close()
        eng.close()
        client.close()
        queue.stop(0)
    assert batch is not None and len(batch.rollouts) == 8, dict(worker.counts)
    returned = {c.request_id: c for c in eng.returned}
    submitted = {r.request_id: r for r in eng.submitted}
    multi = [r for r in batch.rollouts if r.turn_index[-1] > 0]
    assert len(multi) >= 2, [r.metrics for r in batch.rollouts]
    for r in batch.rollouts:
        assert r.engine_id == eng.engine_id and r.group_size == 2
        match_engine(r, returned, submitted, env_reply=lambda k, text: f"={k}\n", tok=tok)
    for r in multi:
        check_logps(r, model, reference, turns=list(range(int(r.turn_index[-1]) + 1)))
