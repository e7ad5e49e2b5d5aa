"""JaxEngine: log-prob parity with the learner, continuous batching, finishing, bad requests,
KV budget, compile stability."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.rollout.engine import EngineClosedError, RequestError
from pipelinerl_jax.rollout.jax_engine import engine_config, validate_engine_config
from pipelinerl_jax.rollout.sampling import truncate
from tests.rollout.conftest import make_engine, random_requests, request

_compiles = []
monitoring.register_event_duration_secs_listener(
    lambda name, *a, **kw: _compiles.append(name)
    if name == "/jax/core/compile/backend_compile_duration" else None)


@pytest.fixture(scope="module")
def engine(models):
    eng = make_engine(models[0])
    eng.warmup()
    yield eng
    eng.close()


def by_id(completions):
    return {(c.request_id, c.sample_index): c for c in completions}


def test_logprobs_match_learner_recompute(engine, models, reference):
    reqs = random_requests(6, seed=1, temperature=0.7)
    for c in engine.generate(reqs):
        assert c.finish_reason == "length" and len(c.token_ids) > 0
        ref = reference(models[0], c.prompt_ids, c.token_ids, 0.7)
        np.testing.assert_allclose(c.logp_behaviour, ref, atol=1e-4)
        assert (c.version == 0).all() and (c.kv_version == 0).all() and c.start_version == 0


def test_truncated_logprobs_are_renormalised_over_the_support(engine, models, reference,
                                                              full_logits):
    """logprob_mode='sampled' with top-k/top-p: log q = tempered logp - logsumexp over the
    support, which a learner recomputes from its own logits with `sampling.truncate`."""
    trunc = jax.jit(truncate)
    reqs = random_requests(4, seed=2, temperature=0.9, top_k=5, top_p=0.8)
    for c in engine.generate(reqs):
        seq = np.concatenate([c.prompt_ids, c.token_ids])
        z = np.zeros((64, 64), np.float32)  # fixed shape: one compile of `truncate`
        z[:len(c.token_ids)] = full_logits(models[0], seq)[len(c.prompt_ids) - 1:-1] / 0.9
        zt = np.asarray(trunc(jnp.asarray(z), jnp.full((64,), 5), jnp.full((64,), 0.8)))
        zt = zt[np.arange(len(c.token_ids))]
        picked = zt[np.arange(len(zt)), c.token_ids]
        assert np.isfinite(picked).all(), "sampled a token outside the top-k/top-p support"
        support = np.isfinite(zt)
        lse = np.log(np.where(support, np.exp(zt - picked[:, None]), 0).sum(-1)) + picked
        np.testing.assert_allclose(c.logp_behaviour, picked - lse, atol=1e-4)
        untruncated = reference(models[0], c.prompt_ids, c.token_ids, 0.9)
        assert (c.logp_behaviour >= untruncated - 1e-6).all()
        assert (support.sum(-1) <= 5).all()


def test_continuous_batching_keeps_slots_full_and_matches_solo_runs(engine):
    reqs = random_requests(20, seed=3, lognormal=(2.2, 0.9), stop_token_ids=(7,))
    engine.stats()  # open a fresh stats window
    together = by_id(engine.generate(reqs))
    st = engine.stats()
    # Every decode step that ran while samples waited had all 4 slots busy.
    assert st["occupancy_while_queued"] == 1.0
    assert st["window_decode_steps"] < sum(r.params.max_new_tokens for r in reqs) / 2
    reasons = {c.finish_reason for c in together.values()}
    assert reasons == {"stop", "length"}
    # Alone, a request runs with other prefill-batch and attention-length buckets: the same
    # tokens, and log-probs equal up to float32 summation order.
    for r in reqs[:8]:
        solo = engine.generate([r])[0]
        c = together[(r.request_id, 0)]
        np.testing.assert_array_equal(solo.token_ids, c.token_ids)
        np.testing.assert_allclose(solo.logp_behaviour, c.logp_behaviour, atol=1e-5)


def test_finish_reasons_stop_length_and_full_context(engine):
    # A stop token is the last token, with its log-prob; nothing follows it.
    free = engine.generate([request("free", [1, 2, 3], max_new_tokens=40, seed=4)])[0]
    stop = int(free.token_ids[5])
    first = int(np.argmax(free.token_ids == stop))
    c = engine.generate([request("stop", [1, 2, 3], max_new_tokens=40, seed=4,
                                 stop_token_ids=(stop, 63))])[0]
    assert c.finish_reason == "stop"
    np.testing.assert_array_equal(c.token_ids, free.token_ids[:first + 1])
    np.testing.assert_allclose(c.logp_behaviour, free.logp_behaviour[:first + 1], atol=1e-6)
    # max_new_tokens reached; context (64) full before max_new_tokens.
    c = engine.generate([request("len", [1], max_new_tokens=3, seed=5)])[0]
    assert (c.finish_reason, len(c.token_ids)) == ("length", 3)
    c = engine.generate([request("ctx", np.arange(60) % 64, max_new_tokens=50, seed=6)])[0]
    assert (c.finish_reason, len(c.token_ids)) == ("length", 4)


def test_n_samples_and_seeds(engine):
    a = engine.generate([request("n", [4, 5], max_new_tokens=12, n=3, seed=11)])
    assert [c.sample_index for c in a] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a}) == 3  # samples of one request differ
    b = engine.generate([request("n", [4, 5], max_new_tokens=12, n=3, seed=11)])
    for x, y in zip(a, b):  # same seed: same samples
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
    # Requests without a seed draw distinct seeds.
    u = engine.generate([request(f"u{i}", [4, 5], max_new_tokens=12) for i in range(3)])
    assert len({tuple(c.token_ids) for c in u}) == 3


@pytest.mark.parametrize("prompt,params,field", [
    ([], {}, "prompt_ids"),
    (np.zeros(64, np.int64), {}, "prompt_ids"),  # longer than the context allows
    ([1, 64], {}, "prompt_ids"),  # token id outside the vocabulary
    ([1, -1], {}, "prompt_ids"),
    (np.array([1.5]), {}, "prompt_ids"),
    ([1], {"max_new_tokens": 0}, "params.max_new_tokens"),
    ([1], {"max_new_tokens": -3}, "params.max_new_tokens"),
    ([1], {"temperature": -1.0}, "params.temperature"),
    ([1], {"temperature": float("nan")}, "params.temperature"),
    ([1], {"top_p": 0.0}, "params.top_p"),
    ([1], {"top_k": -2}, "params.top_k"),
    ([1], {"n": 0}, "params.n"),
    ([1], {"stop_token_ids": (99,)}, "params.stop_token_ids"),
    ([1], {"stop_token_ids": tuple(range(9))}, "params.stop_token_ids"),
])
def test_bad_request_is_rejected_and_others_are_served(engine, prompt, params, field):
    good = request("good", [3, 4], max_new_tokens=5, seed=1)
    engine.submit(good)
    with pytest.raises(RequestError, match=f"request 'bad': {field}"):
        engine.submit(request("bad", prompt, **params))
    out = engine.generate([request("good2", [3, 4], max_new_tokens=5, seed=1)])
    rest = engine.get_completions()
    assert [c.request_id for c in rest] == ["good"] and len(out[0].token_ids) == 5
    np.testing.assert_array_equal(rest[0].token_ids, out[0].token_ids)


def test_duplicate_in_flight_request_id_is_rejected(engine):
    engine.submit(request("dup", [1], max_new_tokens=2))
    with pytest.raises(RequestError, match="already in flight"):
        engine.submit(request("dup", [1], max_new_tokens=2))
    assert engine.generate([request("other", [1], max_new_tokens=2)])
    engine.step()
    assert [c.request_id for c in engine.get_completions()] == ["dup"]


def test_kv_budget_limits_concurrency(models):
    # Each sample reserves prompt (4) + max_new (20) = 24 tokens; a 50-token budget fits two.
    eng = make_engine(models[0], kv_budget_tokens=50)
    reqs = [request(f"k{i}", [1, 2, 3, 4], max_new_tokens=20, seed=i) for i in range(6)]
    for r in reqs:
        eng.submit(r)
    peak, done = 0, []
    while len(done) < 6:
        eng.step()
        done += eng.get_completions()
        s = eng.stats()
        peak = max(peak, s["active_slots"])
        assert s["kv_tokens_reserved"] <= 50 and s["kv_tokens_in_use"] <= 50
    assert peak == 2 and all(len(c.token_ids) == 20 for c in done)
    with pytest.raises(RequestError, match="kv_budget_tokens"):
        eng.submit(request("huge", [1, 2, 3, 4], max_new_tokens=47))


def test_no_recompilation_in_steady_state(engine):
    before = len(_compiles)
    for seed in (10, 11):
        engine.generate(random_requests(12, seed=seed, max_prompt=40, lognormal=(2.5, 1.0),
                                        temperature=0.9, top_p=0.9, stop_token_ids=(9,)))
    engine.stats()
    assert len(_compiles) == before, "serving compiled new programs after warmup"


def test_abort_and_close(models):
    eng = make_engine(models[0])
    eng.submit(request("a", [1, 2], max_new_tokens=40, n=2, seed=1))
    eng.submit(request("b", [1, 2], max_new_tokens=40, seed=2))
    eng.step()
    assert eng.abort("a") == 2
    aborted = eng.get_completions()
    assert [(c.request_id, c.finish_reason) for c in aborted] == [("a", "abort")] * 2
    assert all(len(c.token_ids) == len(c.logp_behaviour) >= 1 for c in aborted)
    eng.submit(request("c", [1], max_new_tokens=40, seed=3))
    eng.step()
    eng.close()
    out = {c.request_id: c for c in eng.get_completions()}
    assert {k: c.finish_reason for k, c in out.items()} == {"b": "abort", "c": "abort"}
    with pytest.raises(EngineClosedError):
        eng.submit(request("d", [1], max_new_tokens=2))
    assert not eng.health()["ok"]


def test_engine_config_validation():
    validate_engine_config(engine_config())
    for key, value in [("max_slots", 0), ("kv_policy", "drop"), ("prefill_buckets", (32, 16)),
                       ("cache_buckets", (512,)), ("logprob_mode", "raw"), ("dtype", "int8"),
                       ("steps_per_sync", -1), ("kv_budget_tokens", 1)]:
        cfg = engine_config()
        cfg[key] = value
        with pytest.raises(ConfigError, match=rf"^engine\.{key}:"):
            validate_engine_config(cfg)
    cfg = engine_config()
    cfg.unknown = 1
    with pytest.raises(ConfigError, match=r"^engine\.unknown:"):
        validate_engine_config(cfg)
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.max_slots:"):
        validate_engine_config(engine_config().copy_and_resolve_references() | {}, "x") \
            if False else validate_engine_config(_with(max_slots=-1), "rollout.engine")


def _with(**kw):
    cfg = engine_config()
    cfg.update(kw)
    return cfg
