"""SGLangEngine against two protocol-faithful test-server processes that generate with a real
JaxEngine: parsing (single and batched forms, seeded or not) checked against the servers' own
records, refits between exact decode steps in 'retract' and 'in_place' mode with log-probs
recomputed here, provenance without per-token spans, server aborts (resubmit with prefix /
drop), user aborts and close() reaching every sample on the server, and HTTP 400 messages."""
import threading
import urllib.error

import numpy as np
import pytest

from pipelinerl_jax.models import save_pretrained
from pipelinerl_jax.rollout.engine import RequestError
from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.rollout.sglang_protocol import version_of
from pipelinerl_jax.testing.sglang_process import ServerProcess
from pipelinerl_jax.transport.versioned_dir import write_versioned_dir
from tests.rollout.conftest import request

pytestmark = pytest.mark.slow  # starts other processes: left out of the fast tier (pytest.ini)

# One engine shape for both servers: one prefill and one decode program to compile.
SHAPE = '{"max_slots": 4, "max_seq_len": 32, "prefill_buckets": [32], "cache_buckets": [32], ' \
        '"max_prefill_batch": 1, "steps_per_sync": 4}'


@pytest.fixture(scope="module")
def weights(models, tmp_path_factory):
    """HF version directories v0, v1 (the learner's layout) of the conftest models 0 and 1."""
    root = str(tmp_path_factory.mktemp("weights"))
    return {v: write_versioned_dir(root, v, lambda d, v=v: save_pretrained(models[v], d))
            for v in (0, 1)}


@pytest.fixture(scope="module")
def servers(weights):
    """Server 'retract' (KV recomputed on an update) and server 'in_place' (KV kept)."""
    procs = {}
    try:
        for name, policy in (("retract", "recompute"), ("in_place", "keep")):
            procs[name] = ServerProcess(["--model-path", weights[0], "--port", "0",
                                         "--weight-version", "0", "--kv-policy", policy,
                                         "--engine", SHAPE], wait_ready=False)
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


@pytest.fixture
def fresh(servers):
    """The servers with empty records and default switches."""
    for p in servers.values():
        p.call("POST", "/_test/reset")
        p.configure(auto_step=True, abort_next=0, version_spans=True)
    yield servers
    for p in servers.values():
        p.configure(auto_step=True)


def engine_for(*procs, **config):
    return SGLangEngine([p.url for p in procs], dict(health_deadline_s=60.0, **config),
                        vocab_size=64, max_seq_len=32)


def matching(record, rid, sample_index):
    """Record entries of one sample, in order (a resubmitted sample has several). Server
    rids are '<request>/<job>/<sample>'."""
    out = []
    for r in record:
        head, job, index = r["rid"].split("/")
        if head == rid and int(index) == sample_index:
            out.append(r)
    return out


def test_generation_on_two_servers_matches_their_records(fresh, models, reference):
    a, b = fresh["retract"], fresh["in_place"]
    reqs = [request("seeded", [1, 5, 9], max_new_tokens=10, n=3, seed=7, temperature=0.8),
            request("unseeded", [2, 4], max_new_tokens=8, n=2),
            request("one", [3, 3, 3, 3], max_new_tokens=12, seed=1, stop_token_ids=(5, 9, 17)),
            request("greedy", [7, 1], max_new_tokens=6, temperature=0.0)]
    with engine_for(a, b) as eng:
        assert eng.version == 0  # read from the servers' weight_version
        out = eng.generate(reqs)
        st = eng.stats()
    assert [(c.request_id, c.sample_index) for c in out] == [
        ("seeded", 0), ("seeded", 1), ("seeded", 2), ("unseeded", 0), ("unseeded", 1),
        ("one", 0), ("greedy", 0)]
    record = a.record() + b.record()
    assert a.record() and b.record(), "least-loaded routing used both servers"
    for c in out:
        r = next(r for r in reqs if r.request_id == c.request_id)
        [entry] = matching(record, c.request_id, c.sample_index)
        np.testing.assert_array_equal(c.token_ids, entry["output_ids"])
        np.testing.assert_array_equal(c.logp_behaviour, np.float32(entry["output_logprobs"]))
        assert c.version.tolist() == [version_of(v) for v in entry["versions"]] == \
            [0] * len(c.token_ids)
        assert (c.kv_version == 0).all() and c.start_version == 0
        assert entry["input_ids"] == r.prompt_ids.tolist()
        assert c.engine_id == "sglang" and c.submit_time <= c.start_time <= c.finish_time
        # Real log-probs: log softmax(logits / T) of the v0 weights, recomputed here.
        t = r.params.temperature or 1.0
        ref = reference(models[0], c.prompt_ids, c.token_ids, t)
        np.testing.assert_allclose(c.logp_behaviour, ref, atol=1e-4)
    seeded = [c.token_ids.tolist() for c in out if c.request_id == "seeded"]
    assert len({tuple(s) for s in seeded}) == 3, "each sample of a seeded request has its seed"
    one = next(c for c in out if c.request_id == "one")
    assert one.finish_reason == ("stop" if one.token_ids[-1] in (5, 9, 17) else "length")
    assert st["completed_samples"] == 7 and st["generated_tokens"] == sum(
        len(c.token_ids) for c in out)


def _step_until_live(proc, n):
    import time
    for _ in range(200):
        if proc.stats()["live"] >= n:
            return
        time.sleep(0.02)
    raise AssertionError("the server never received the request")


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_refit_between_decode_steps(fresh, weights, models, reference, replay_keep, mode):
    """4 tokens with v0, refit to v1 (written by save_pretrained into the learner's versioned
    layout), the rest with v1: versions from the server's spans, KV versions by pause mode,
    log-probs equal to a recomputation with the weights of each token's version."""
    proc = fresh[mode]
    proc.configure(auto_step=False)
    with engine_for(proc, pause_mode=mode) as eng:
        eng.submit(request("r", [4, 8, 15, 16], max_new_tokens=14, seed=3))
        _step_until_live(proc, 1)
        proc.call("POST", "/_test/step", {"steps": 1})  # prefill + one 4-step decode chunk
        eng.update_weights(weights[1], 1)
        assert eng.version == 1
        proc.configure(auto_step=True)
        [c] = eng.get_completions(timeout=30)
        [after] = eng.generate([request("after", [4, 8, 15, 16], max_new_tokens=6, seed=3)])
        st = eng.stats()
    split = 5  # the prefill token + 4 decode steps
    assert c.version.tolist() == [0] * split + [1] * (len(c.token_ids) - split)
    [entry] = matching(proc.record(), "r", 0)
    assert [version_of(v) for v in entry["kv_versions"]] == c.kv_version.tolist()
    if mode == "retract":  # KV recomputed with v1: a plain forward of each version's weights
        assert (c.kv_version == c.version).all()
        ref = np.where(c.version == 0, reference(models[0], c.prompt_ids, c.token_ids),
                       reference(models[1], c.prompt_ids, c.token_ids))
    else:  # KV of the first tokens kept: v1 attends to keys/values written by v0
        assert (c.kv_version == 0).all()
        ref = replay_keep(models, c.prompt_ids, c.token_ids, c.version, 0)
    np.testing.assert_allclose(c.logp_behaviour, ref, atol=1e-4)
    assert (after.version == 1).all() and after.start_version == 1
    np.testing.assert_allclose(after.logp_behaviour,
                               reference(models[1], after.prompt_ids, after.token_ids), atol=1e-4)
    [server] = st["servers"]
    assert server["version"] == 1 and server["refits"] == 1 and server["last_refit_s"] > 0
    assert proc.stats()["pause_mode"] is None and not proc.stats()["paused"]
    proc_reset(proc, weights)


def proc_reset(proc, weights):
    """Back to v0 weights under label '0' for the next test."""
    proc.call("POST", "/pause_generation", {"mode": "abort"})
    proc.call("POST", "/update_weights_from_disk", {"model_path": weights[0],
                                                    "weight_version": "0"})
    proc.call("POST", "/continue_generation", {})


def test_without_version_spans_a_straddling_sample_gets_its_oldest_version(fresh, weights):
    proc = fresh["retract"]
    proc.configure(auto_step=False, version_spans=False)
    with engine_for(proc) as eng:
        eng.submit(request("r", [4, 8, 15], max_new_tokens=12, seed=5))
        _step_until_live(proc, 1)
        proc.call("POST", "/_test/step", {"steps": 1})
        eng.update_weights(weights[1], 1)
        proc.configure(auto_step=True)
        [c] = eng.get_completions(timeout=30)
        [after] = eng.generate([request("after", [1, 2], max_new_tokens=4)])
        st = eng.stats()
    assert (c.version == 0).all() and (c.kv_version == 0).all()  # lag over-, never understated
    assert st["inexact_provenance_samples"] == 1
    assert (after.version == 1).all()  # no refit during it: exact from weight_version
    proc_reset(proc, weights)


@pytest.mark.parametrize("policy", ["resubmit", "drop"])
def test_server_abort_resubmits_with_prefix_or_drops(fresh, models, reference, policy):
    proc = fresh["retract"]
    proc.configure(abort_next=1, abort_after_tokens=3)
    with engine_for(proc, on_abort=policy) as eng:
        out = eng.generate([request("r", [9, 9, 2], max_new_tokens=10, n=2, seed=11)])
        st = eng.stats()
    record = proc.record()
    for c in out:
        entries = matching(record, "r", c.sample_index)
        assert entries[0]["finish_reason"]["type"] == "abort"
        assert len(entries[0]["output_ids"]) == 3
        if policy == "drop":
            assert c.finish_reason == "abort" and c.token_ids.tolist() == entries[0]["output_ids"]
            continue
        first, cont = entries
        # The continuation is the prompt + the 3 tokens, with the budget reduced by them.
        assert cont["input_ids"] == [9, 9, 2] + first["output_ids"]
        assert cont["sampling_params"]["max_new_tokens"] == 7
        assert c.token_ids.tolist() == first["output_ids"] + cont["output_ids"]
        np.testing.assert_array_equal(
            c.logp_behaviour, np.float32(first["output_logprobs"] + cont["output_logprobs"]))
        assert c.finish_reason == "length" and len(c.token_ids) == 10
        np.testing.assert_allclose(c.logp_behaviour,
                                   reference(models[0], c.prompt_ids, c.token_ids), atol=1e-4)
    key = "resubmitted_samples" if policy == "resubmit" else "dropped_aborted_samples"
    assert st[key] == 2 and st["server_aborted_segments"] == 2


def test_user_abort_of_running_and_queued_requests(fresh):
    proc = fresh["retract"]
    proc.configure(auto_step=False)
    with engine_for(proc, concurrency_per_server=2) as eng:
        eng.submit(request("running", [1, 2, 3], max_new_tokens=20, n=2, seed=1))
        eng.submit(request("queued", [1, 2, 3], max_new_tokens=20, seed=2))
        _step_until_live(proc, 2)
        proc.call("POST", "/_test/step", {"steps": 1})
        assert eng.stats()["queued_samples"] == 1  # the server's 2 slots are taken
        assert eng.abort("queued") == 1
        assert eng.abort("running") == 2
        got = {}
        for _ in range(60):
            got.update({(c.request_id, c.sample_index): c
                        for c in eng.get_completions(timeout=0.5)})
            if len(got) == 3:
                break
        assert eng.abort("running") == 0
    proc.configure(auto_step=True)
    assert set(got) == {("queued", 0), ("running", 0), ("running", 1)}
    assert all(c.finish_reason == "abort" for c in got.values())
    assert len(got[("queued", 0)].token_ids) == 0
    assert all(len(got[("running", i)].token_ids) == 5 for i in (0, 1))  # not resubmitted


def test_the_test_server_names_and_aborts_requests_as_sglang_does(fresh):
    """The fake's rid rules (its module docstring): n>1 children get fresh rids, an abort of
    a rid no request holds does nothing, a held rid aborts every rid it prefixes."""
    proc = fresh["retract"]
    proc.configure(auto_step=False)
    answers = {}
    bodies = {"parallel": dict(input_ids=[1, 2], rid="p", sampling_params=dict(
                  max_new_tokens=20, n=2)),
              "x": dict(input_ids=[1], rid="x", sampling_params=dict(max_new_tokens=20)),
              "x1": dict(input_ids=[2], rid="x1", sampling_params=dict(max_new_tokens=20))}
    threads = {k: threading.Thread(target=lambda k=k: answers.__setitem__(
        k, proc.call("POST", "/generate", bodies[k])), daemon=True) for k in bodies}
    for t in threads.values():
        t.start()
    _step_until_live(proc, 4)
    proc.call("POST", "/abort_request", {"rid": "p"})  # the parent: no request holds it
    proc.call("POST", "/abort_request", {"rid": "x"})  # held: aborts 'x' and 'x1'
    threads["x"].join(30)
    threads["x1"].join(30)
    assert proc.stats()["live"] == 2
    assert [answers[k]["meta_info"]["finish_reason"]["type"] for k in ("x", "x1")] == [
        "abort", "abort"]
    proc.call("POST", "/abort_request", {"rid": "", "abort_all": True})
    threads["parallel"].join(30)
    ids = [o["meta_info"]["id"] for o in answers["parallel"]]
    assert len(set(ids)) == 2 and not any(i.startswith("p") for i in ids)
    with pytest.raises(urllib.error.HTTPError, match="400"):
        proc.call("POST", "/generate", dict(input_ids=[[1], [2]], rid=["a", "a"]))


def test_abort_of_an_unseeded_request_stops_every_sample_on_the_server(fresh):
    """Regression: an unseeded n>1 request was sent with sampling_params.n, whose children
    SGLang renames (fresh rids), so aborting the rid the engine sent did nothing: the samples
    never ended 'abort' and the server kept generating."""
    proc = fresh["retract"]
    proc.configure(auto_step=False)
    with engine_for(proc) as eng:
        eng.submit(request("u", [1, 2, 3], max_new_tokens=20, n=3))
        _step_until_live(proc, 3)
        proc.call("POST", "/_test/step", {"steps": 1})
        assert eng.abort("u") == 3
        got = {}
        for _ in range(20):
            got.update({c.sample_index: c for c in eng.get_completions(timeout=0.5)})
            if len(got) == 3:
                break
        assert proc.stats()["live"] == 0, "the server still generates the aborted samples"
    assert sorted(got) == [0, 1, 2]
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 5 for c in got.values())


def test_unseeded_copies_carry_distinct_engine_drawn_seeds(fresh):
    """sglang-jax with deterministic sampling (needed for seeds to reproduce) samples every
    unseeded copy with the same default seed: the n samples of a group were identical
    (measured by scripts/sglang_conformance.py). The engine draws one seed per copy."""
    proc = fresh["retract"]
    proc.configure(auto_step=False)
    with engine_for(proc) as eng:
        eng.submit(request("d", [1, 2, 3], max_new_tokens=4, n=3))
        seeds = [smp.seed for smp in eng._live["d"]]
        eng.submit(request("one", [1, 2, 3], max_new_tokens=4, n=1))
        single = eng._live["one"][0].seed
    assert None not in seeds and len(set(seeds)) == 3
    assert single is None  # a lone sample keeps the server's own sampling


def test_the_test_server_refuses_to_flush_its_cache_while_requests_run(fresh):
    """As SGLang (scheduler flush_cache -> HTTP 400 when not idle; sglang-jax measured the
    same in scripts/sglang_conformance.py)."""
    import urllib.error
    proc = fresh["retract"]
    proc.configure(auto_step=False)
    assert proc.call("POST", "/flush_cache") is None  # idle: 200
    with engine_for(proc) as eng:
        eng.submit(request("f", [1, 2, 3], max_new_tokens=20))
        _step_until_live(proc, 1)
        with pytest.raises(urllib.error.HTTPError) as e:
            proc.call("POST", "/flush_cache")
        assert e.value.code == 400
        eng.abort("f")


def test_close_stops_an_unseeded_request_on_the_server(fresh):
    proc = fresh["retract"]
    proc.configure(auto_step=False)
    eng = engine_for(proc)
    eng.submit(request("u", [1, 2, 3], max_new_tokens=20, n=2))
    _step_until_live(proc, 2)
    eng.close()
    assert proc.stats()["live"] == 0, "close() left the server generating"
    assert sorted((c.sample_index, c.finish_reason) for c in eng.get_completions()) == [
        (0, "abort"), (1, "abort")]


def test_http_400_surfaces_with_the_servers_message(fresh):
    proc = fresh["in_place"]
    # The engine believes in a 64-token context, the server has 32: the server refuses.
    with SGLangEngine([proc.url], {"health_deadline_s": 60.0}, vocab_size=64,
                      max_seq_len=64) as eng:
        long_prompt = list(range(1, 41))
        with pytest.raises(RequestError, match=r"request 'long'.*HTTP 400.*The input \(40 "
                                               r"tokens\) is longer than the model's context "
                                               r"length \(32 tokens\)"):
            eng.generate([request("long", long_prompt, max_new_tokens=4)])
        eng.submit(request("long2", long_prompt, max_new_tokens=4))
        eng.submit(request("fine", [1, 2], max_new_tokens=4))
        got, errors = [], []
        for _ in range(50):
            try:
                got += eng.get_completions(timeout=0.2)
            except RequestError as e:
                errors.append(str(e))
            if got and errors:
                break
        assert [c.request_id for c in got] == ["fine"]
        assert len(errors) == 1 and proc.url in errors[0] and "'long2'" in errors[0]
        assert eng.health()["ok"] and eng.stats()["request_errors"] == 2
