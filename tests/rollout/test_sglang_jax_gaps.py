"""What a real SGLang-family server showed (sglang-jax 0.1.0rc0, scripts/sglang_conformance.py),
encoded against the in-repo test server's switches: log-probs resent at every k-th token,
no weight-update endpoint (a config that refits fails at start-up, naming server and
endpoint), no `weight_version` anywhere (tokens carry the version the engine holds)."""
import numpy as np
import pytest

from pipelinerl_jax.rollout.sglang_client import MissingEndpointError
from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.testing.sglang_process import ServerProcess
from tests.rollout.conftest import request

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

FAST = dict(health_deadline_s=30.0, backoff_initial_s=0.01, backoff_max_s=0.05)


@pytest.fixture(scope="module")
def server():
    p = ServerProcess(["--stub", "--port", "0", "--vocab-size", "56", "--weight-version", "0"])
    yield p
    p.kill()


@pytest.fixture
def gaps(server):
    """Sets switches on the shared server for one test, and restores them after."""
    def set_(**switches):
        server.configure(**switches)
    yield set_
    server.configure(resend_logprobs_every=0, update_endpoint=True, weight_version_field=True)


def test_resent_logprobs_are_read_once(server, gaps):
    gaps(resend_logprobs_every=4)  # sglang-jax: 50; 4 puts several flushes in 10 tokens
    server.call("POST", "/_test/reset")
    with SGLangEngine([server.url], FAST, vocab_size=56, max_seq_len=64) as eng:
        out = eng.generate([request("a", [1, 2, 3], max_new_tokens=10, n=2, seed=7),
                            request("b", [1, 2, 4], max_new_tokens=9, n=2),
                            request("c", [1, 2, 5], max_new_tokens=3)], timeout=30)
        assert eng.stats()["request_errors"] == 0
    answered = {}
    for r in server.record():
        answered.setdefault(r["rid"].split("/")[0], []).append(r["output_ids"])
    assert len(out) == 5
    for c in out:
        assert c.finish_reason == "length"
        assert len(c.token_ids) == {"a": 10, "b": 9, "c": 3}[c.request_id]
        assert c.token_ids.tolist() in answered[c.request_id]
        np.testing.assert_array_equal(c.logp_behaviour, -1.0)  # the stub's, once per token


def test_a_config_that_refits_fails_at_startup_without_the_update_endpoint(server, gaps,
                                                                          tmp_path):
    gaps(update_endpoint=False)
    with pytest.raises(MissingEndpointError) as e:
        SGLangEngine([server.url], FAST, vocab_size=56, max_seq_len=64, require_refit=True)
    assert f"{server.url} has no /update_weights_from_disk" in str(e.value)
    assert "/pause_generation" not in str(e.value)  # only what is missing is named
    # The pipeline's engine always refits: make_sglang_engine probes.
    from pipelinerl_jax.rollout.sglang_engine import make_sglang_engine
    from tests.rollout.test_sglang_config import base_config, resolve
    cfg = base_config()
    cfg.sampler.kind = "sglang"
    cfg.sglang.urls = (server.url,)
    cfg.sglang.health_deadline_s = 30.0
    cfg = resolve(cfg)
    with pytest.raises(MissingEndpointError, match="has no /update_weights_from_disk"):
        make_sglang_engine(cfg, "", 0, str(tmp_path))
    # Sampling alone (no refit) works against such a server.
    with SGLangEngine([server.url], FAST, vocab_size=56, max_seq_len=64) as eng:
        assert eng.generate([request("s", [1, 2], max_new_tokens=2)])[0].finish_reason == "length"
    gaps(update_endpoint=True)  # a server that has it passes the probe
    SGLangEngine([server.url], FAST, vocab_size=56, max_seq_len=64, require_refit=True).close()


def test_no_weight_version_anywhere_means_the_engines_version(server, gaps):
    gaps(weight_version_field=False)
    assert "weight_version" not in server.call("GET", "/get_model_info")
    with SGLangEngine([server.url], FAST, vocab_size=56, max_seq_len=64, version=3) as eng:
        out = eng.generate([request("v", [1, 2, 3], max_new_tokens=4, n=2, seed=1)])
        assert eng.stats()["inexact_provenance_samples"] == 0
    for c in out:
        assert c.version.tolist() == [3] * 4 and c.kv_version.tolist() == [3] * 4
        assert c.start_version == 3
