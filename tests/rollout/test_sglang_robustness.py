"""SGLangEngine failure handling against zero-cost (stub) test-server processes: 503 at
startup and intermittent 503s retried, the per-server concurrency limit, a killed server
removed from routing (its requests finish on the other) and re-admitted after a refit when
it comes back."""
import json
import time

import numpy as np
import pytest

from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.testing.sglang_process import ServerProcess
from tests.rollout.conftest import request

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

FAST = dict(health_deadline_s=30.0, backoff_initial_s=0.01, backoff_max_s=0.05)


def stub(*args, wait_ready=True):
    return ServerProcess(["--stub", "--port", "0", "--vocab-size", "64", *args],
                         wait_ready=wait_ready)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        p.kill()


def collect(eng, n, timeout=30.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += eng.get_completions(timeout=0.2)
    assert len(got) == n, f"{len(got)} of {n} samples finished"
    return got


def test_startup_503_and_intermittent_503s_are_retried(procs):
    """503 while the server loads (kept-alive probes included), then in its first second
    of serving, then on every second /generate: all retried."""
    procs.append(stub("--startup-delay-s", "0.6", "--startup-503-s", "0.5", "--fail-every", "2",
                      wait_ready=False))
    p = procs[0]
    eng = SGLangEngine([p.url], dict(FAST, max_retries=3), vocab_size=64, max_seq_len=64)
    health = p.stats()["counts"]  # it waited for /health to stop answering 503
    assert health["health_503"] >= 1 and health["health_ok"] >= 1
    with eng:
        out = [eng.generate([request(f"r{i}", [1, 2, i], max_new_tokens=5)])[0]
               for i in range(6)]
        st = eng.stats()
    calls = p.stats()["counts"]["generate"]
    assert calls == 12 - 1 or calls == 12  # every second call failed with 503 and was retried
    assert st["retries"] == calls - 6 and st["request_errors"] == 0
    record = {r["rid"].split("/")[0]: r for r in p.record()}
    for c in out:
        assert c.finish_reason == "length"
        assert c.token_ids.tolist() == record[c.request_id]["output_ids"]
        np.testing.assert_array_equal(c.logp_behaviour, -1.0)


def test_requests_beyond_the_concurrency_limit_wait_in_the_engine(procs):
    procs.append(stub("--delay-s", "0.3"))
    with SGLangEngine([procs[0].url], dict(FAST, concurrency_per_server=2), vocab_size=64,
                      max_seq_len=64) as eng:
        for i in range(5):
            eng.submit(request(f"r{i}", [1, i], max_new_tokens=3))
        time.sleep(0.1)
        st = eng.stats()
        assert st["active_slots"] == 2 and st["queued_samples"] == 3 and st["num_slots"] == 2
        collect(eng, 5)


def test_dead_server_is_removed_and_readmitted_after_a_refit(procs, tmp_path):
    procs.extend([stub(), stub("--delay-s", "0.5")])
    live, dying = procs
    weights = tmp_path / "v00000001"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"vocab_size": 64}))
    eng = SGLangEngine([live.url, dying.url],
                       dict(FAST, max_retries=2, health_check_interval_s=0.2),
                       vocab_size=64, max_seq_len=64, version=0)
    with eng:
        eng.update_weights(str(weights), 1)
        for i in range(8):
            eng.submit(request(f"r{i}", [3, i], max_new_tokens=4, n=2, seed=i))
        time.sleep(0.2)  # requests are in flight on the slow server
        assert eng.stats()["servers"][1]["in_flight"] > 0
        dying.kill()
        out = collect(eng, 16)
        assert all(c.finish_reason == "length" and len(c.token_ids) == 4 for c in out)
        served = {(r["rid"].split("/")[0], int(r["rid"].split("/")[2])): r["output_ids"]
                  for r in live.record()}  # server rids: '<request>/<job>/<sample>'
        assert all(served[(c.request_id, c.sample_index)] == c.token_ids.tolist() for c in out)
        st, health = eng.stats(), eng.health()
        assert st["servers_down"] == [dying.url] and st["rerouted_requests"] >= 1
        assert st["servers"][1]["removed"] == 1
        assert health["ok"] and dying.url in health["servers_down"]

        # The server comes back on the same port: probed, refit to version 1, re-admitted.
        procs.append(stub("--port", str(dying.port)))
        back = procs[-1]
        deadline = time.monotonic() + 20
        while eng.health()["servers_down"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not eng.health()["servers_down"], eng.health()
        assert back.stats()["weight_version"] == "1"
        assert back.stats()["counts"]["update_weights"] == 1
        eng.generate([request(f"again{i}", [5], max_new_tokens=2) for i in range(6)])
        assert back.record(), "the re-admitted server serves requests again"


def test_failed_refit_is_reported_and_the_server_keeps_serving(procs, tmp_path):
    procs.append(stub())
    with SGLangEngine([procs[0].url], FAST, vocab_size=64, max_seq_len=64, version=0) as eng:
        with pytest.raises(RuntimeError, match=r"version 1 could not be installed.*Failed to "
                                               r"update weights"):
            eng.update_weights(str(tmp_path / "missing"), 1)
        assert eng.version == 0
        health = eng.health()
        assert health["ok"] and procs[0].url in health["refit_errors"]
        assert procs[0].stats()["paused"] is False  # continued after the failed load
        [c] = eng.generate([request("r", [1], max_new_tokens=3)])
        assert (c.version == -1).all()  # the stub's launch label 'default'
        with pytest.raises(ValueError, match="version 1 is not newer"):
            eng.update_weights(str(tmp_path), 1)  # 1 was accepted once: never again


def test_close_returns_unanswered_samples_as_aborted(procs):
    procs.append(stub("--delay-s", "30"))
    eng = SGLangEngine([procs[0].url], dict(FAST, control_timeout_s=0.5), vocab_size=64,
                       max_seq_len=64)
    eng.submit(request("slow", [1], max_new_tokens=3, n=2))
    eng.submit(request("queued", [1], max_new_tokens=3))
    time.sleep(0.2)
    eng.close()
    out = eng.get_completions()
    # close did not wait out the 30 s reply: the server finished no sample
    assert not [r for r in procs[0].record() if r["finish_reason"]["type"] != "abort"]
    assert sorted((c.request_id, c.finish_reason) for c in out) == [
        ("queued", "abort"), ("slow", "abort"), ("slow", "abort")]
    assert eng.health()["closed"] and not eng.health()["ok"]


def test_version_published_while_every_server_is_down_is_installed_when_one_returns(procs, tmp_path):
    """The learner publishes only when it trains, and it trains only on new samples: a
    version missed while no server was up must go live when a server comes back, or the
    engine stays behind forever (found as a stalled run in the SGLang fault test)."""
    procs.append(stub())
    only = procs[0]
    dirs = {}
    for v in (1, 2):
        dirs[v] = tmp_path / f"v{v:08d}"
        dirs[v].mkdir()
        (dirs[v] / "config.json").write_text(json.dumps({"vocab_size": 64}))
    eng = SGLangEngine([only.url], dict(FAST, max_retries=1, health_check_interval_s=0.2),
                       vocab_size=64, max_seq_len=64, version=0)
    with eng:
        eng.update_weights(str(dirs[1]), 1)
        only.kill()
        eng.submit(request("r0", [3], max_new_tokens=2))  # finds the server gone
        deadline = time.monotonic() + 20
        while not eng.health()["servers_down"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(eng.health()["servers_down"]) == [only.url]
        with pytest.raises(RuntimeError, match="none up"):
            eng.update_weights(str(dirs[2]), 2)
        assert eng.version == 1
        procs.append(stub("--port", str(only.port)))
        deadline = time.monotonic() + 20
        while (eng.version != 2 or eng.health()["servers_down"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.version == 2 and not eng.health()["servers_down"]
        assert procs[-1].stats()["weight_version"] == "2"
        assert eng.stats()["deferred_refits"] == 1
