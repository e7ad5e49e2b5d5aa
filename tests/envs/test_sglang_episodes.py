"""Multi-turn episodes through `SGLangEngine` against the protocol-faithful test server (a
child process generating with a real JaxEngine): every turn is a `/generate` on `input_ids`,
the episode is token-exact, and each model token's log-prob is the learner's recompute on the
episode's sequence."""
import pytest

from pipelinerl_jax.envs import EpisodeRunner
from pipelinerl_jax.models import save_pretrained
from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.testing.sglang_server import ServerProcess
from tests.envs.conftest import (RANDOM_MODEL_STOPS, ToyTask, check_logps, check_token_exact,
                                 recording, toy_problem)
from tests.rollout.conftest import full_logits, make_model, reference  # noqa: F401

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
