"""The JaxEngine on a paged KV cache (`engine.kv_layout='paged'`): the same tokens as the dense
layout, admission by free pages (more concurrent samples in the same KV bytes), preemption
with recompute when the pool runs dry, and per-token provenance through preemption and an
in-flight update. Memory sizing of the pool."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.models import tiny_config
from pipelinerl_jax.models.paged_attention import init_paged_cache
from pipelinerl_jax.rollout import engine_memory
from pipelinerl_jax.rollout.engine import RequestError
from pipelinerl_jax.rollout.jax_engine import engine_config, validate_engine_config
from pipelinerl_jax.rollout.page_allocator import PageAllocator
from tests.rollout.conftest import make_engine, random_requests, request, run_until

PAGED = dict(kv_layout="paged", page_size=8)

_compiles = []
monitoring.register_event_duration_secs_listener(
    lambda name, *a, **kw: _compiles.append(name)
    if name == "/jax/core/compile/backend_compile_duration" else None)


def _by_id(completions):
    return {c.request_id: c for c in completions}


def _mixed_requests():
    """Greedy and sampled (T = 1, top-p) requests with long-tailed lengths."""
    return (random_requests(6, seed=21, lognormal=(3.3, 0.4), max_new_cap=50, temperature=0.0)
            + random_requests(6, seed=22, lognormal=(3.3, 0.4), max_new_cap=50, top_p=0.9))


def _assert_same_samples(dense, paged):
    assert dense.keys() == paged.keys()
    for rid, d in dense.items():
        p = paged[rid]
        np.testing.assert_array_equal(p.token_ids, d.token_ids, err_msg=rid)
        np.testing.assert_allclose(p.logp_behaviour, d.logp_behaviour, atol=1e-5, err_msg=rid)
        assert p.finish_reason == d.finish_reason


def _run(eng, reqs):
    """Steps `eng` through `reqs`; returns (completions by id, peak active slots)."""
    for r in reqs:
        eng.submit(r)
    done, peak = [], 0
    while len(done) < len(reqs):
        eng.step()
        done += eng.get_completions()
        s = eng.stats()
        peak = max(peak, s["active_slots"])
        assert s["kv_tokens_reserved"] <= s["kv_budget_tokens"]
    return _by_id(done), peak


def test_paged_samples_equal_dense_token_for_token(models):
    reqs = _mixed_requests()
    dense, _ = _run(make_engine(models[0]), reqs)
    eng = make_engine(models[0], **PAGED)
    paged, _ = _run(eng, reqs)
    _assert_same_samples(dense, paged)
    s = eng.stats()
    assert s["kv_layout"] == "paged" and s["preemptions"] == 0
    assert s["kv_pages_free"] == s["kv_pages_total"] == 256 // 8  # every page back


def test_tiny_pool_preempts_and_still_equals_dense(models):
    """A 9-page pool (72 tokens) for 4 slots of up to ~60 tokens each: samples are preempted
    and recomputed, every sample completes, and the tokens are the dense engine's."""
    reqs = _mixed_requests()
    dense, dense_peak = _run(make_engine(models[0]), reqs)
    eng = make_engine(models[0], kv_budget_tokens=72, **PAGED)
    paged, _ = _run(eng, reqs)
    _assert_same_samples(dense, paged)
    s = eng.stats()
    assert s["preemptions"] > 0 and s["kv_pages_free"] == 9
    # a preempted sample keeps its first admission's start
    assert all(c.start_version == 0 for c in paged.values())


def test_running_samples_are_packed_into_fewer_decode_rows(models):
    """16 slots for 12 samples: all run at once, and as the tail thins out the running samples
    move into fewer decode rows (slot state and page-table rows move, K/V stays in its pages);
    the tokens are still the dense engine's, and no page outlives its sample."""
    reqs = _mixed_requests()
    dense, _ = _run(make_engine(models[0]), reqs)
    eng = make_engine(models[0], max_slots=16, **PAGED)
    paged, peak = _run(eng, reqs)
    _assert_same_samples(dense, paged)
    s = eng.stats()
    assert peak == len(reqs) <= 16 and s["slot_moves"] > 0
    assert s["kv_pages_free"] == s["kv_pages_total"]


def test_admission_by_free_pages_runs_more_samples_in_the_same_bytes(models):
    """96 tokens of KV: the dense layout reserves prompt + max_new (4 + 40) per sample and
    runs 2 at a time; the paged one admits by the pages a sample holds and runs all 4 slots."""
    reqs = [request(f"a{i}", [1, 2, 3, 4 + i], max_new_tokens=40, seed=i, temperature=0.0)
            for i in range(8)]
    dense, dense_peak = _run(make_engine(models[0], kv_budget_tokens=96), reqs)
    paged, paged_peak = _run(make_engine(models[0], kv_budget_tokens=96, **PAGED), reqs)
    assert dense_peak == 2 and paged_peak == 4
    _assert_same_samples(dense, paged)


def test_no_recompilation_after_warmup_even_while_preempting(models):
    eng = make_engine(models[0], kv_budget_tokens=80, **PAGED)
    eng.warmup()
    before = len(_compiles)
    eng.generate(random_requests(12, seed=30, max_prompt=40, lognormal=(3.0, 0.8),
                                 temperature=0.9, top_p=0.9, stop_token_ids=(9,)))
    eng.stats()
    assert eng.stats()["preemptions"] > 0
    assert len(_compiles) == before, "serving compiled new programs after warmup"


def test_preemption_provenance_through_an_update(models, reference):
    """kv_policy='keep', a 12-page pool, an update to version 1 mid-decode: a sample preempted
    after the update is recomputed by version 1, so its later tokens report kv_version 1 and
    their log-probs are version 1's full forward; earlier tokens keep kv_version 0."""
    eng = make_engine(models[0], kv_budget_tokens=96, kv_policy="keep", **PAGED)
    reqs = [request(f"p{i}", [1, 2, 3, 4 + i], max_new_tokens=40, seed=i, temperature=1.0)
            for i in range(6)]
    for r in reqs:
        eng.submit(r)
    eng.step()
    eng.step()
    eng.update_weights(models[1], 1)
    done = run_until(eng, len(reqs))
    assert eng.stats()["preemptions"] > 0
    recomputed = 0
    for c in done:
        assert len(c.token_ids) == 40 and c.finish_reason == "length"
        assert (np.diff(c.version) >= 0).all() and (np.diff(c.kv_version) >= 0).all()
        assert (c.kv_version <= c.version).all()
        v0 = (c.version == 0)
        np.testing.assert_allclose(c.logp_behaviour[v0],
                                   reference(models[0], c.prompt_ids, c.token_ids)[v0],
                                   atol=1e-4)
        fresh = c.kv_version == 1  # KV all written by version 1 (admission or recompute)
        np.testing.assert_allclose(c.logp_behaviour[fresh],
                                   reference(models[1], c.prompt_ids, c.token_ids)[fresh],
                                   atol=1e-4)
        if c.start_version == 0 and fresh.any():
            recomputed += 1
            assert (c.kv_version[:int(np.argmax(fresh))] == 0).all()
    assert recomputed, "no sample admitted at version 0 was recomputed at version 1"


def test_recompute_update_under_a_full_pool_preempts_instead_of_failing(models, reference):
    eng = make_engine(models[0], kv_budget_tokens=64, kv_policy="recompute", **PAGED)
    reqs = [request(f"q{i}", [3, 1, 4, 1 + i], max_new_tokens=30, seed=i, temperature=1.0)
            for i in range(4)]
    for r in reqs:
        eng.submit(r)
    for _ in range(3):
        eng.step()
    eng.update_weights(models[2], 2)
    done = run_until(eng, len(reqs))
    for c in done:
        assert len(c.token_ids) == 30
        np.testing.assert_array_equal(c.kv_version, c.version)  # recompute: always fresh
        for v in np.unique(c.version):
            at = c.version == v
            np.testing.assert_allclose(c.logp_behaviour[at], reference(
                models[int(v)], c.prompt_ids, c.token_ids)[at], atol=1e-4)


def test_abort_and_close_free_every_page(models):
    eng = make_engine(models[0], kv_budget_tokens=96, **PAGED)
    eng.submit(request("a", [1, 2], max_new_tokens=40, n=2, seed=1))
    eng.submit(request("b", [1, 2], max_new_tokens=40, seed=2))
    eng.step()
    assert eng.stats()["kv_pages_free"] < 12
    assert eng.abort("a") == 2
    eng.step()
    eng.close()
    assert eng.stats()["kv_pages_free"] == 12
    small = make_engine(models[0], kv_budget_tokens=32, **PAGED)
    with pytest.raises(RequestError, match="kv_budget_tokens"):  # could never fit the pool
        small.submit(request("big", [1, 2, 3], max_new_tokens=40))
    small.submit(request("fits", [1, 2, 3], max_new_tokens=30))  # 32 positions, 31 stored


def _held_pages(a, row):
    """The pool pages `row`'s table row names (the padding, `num_pages`, left out)."""
    return [p for p in a.tables[row].tolist() if p != a.num_pages]


def test_page_allocator_hands_out_and_takes_back_pages():
    """Rows hold distinct pages, as many as their tokens need (at most `max_pages`); a grow
    that does not fit allocates nothing; released pages are free again and reusable."""
    a = PageAllocator(num_pages=5, page_size=4, num_rows=2, max_pages=3)
    assert a.grow(0, 5) and len(_held_pages(a, 0)) == a.held(0) == 2
    assert a.grow(1, 12) and a.held(1) == 3 and a.free_pages == 0
    assert not set(_held_pages(a, 0)) & set(_held_pages(a, 1))  # no page held twice
    assert sorted(_held_pages(a, 0) + _held_pages(a, 1)) == list(range(5))
    assert not a.grow(0, 9) and a.held(0) == 2  # all or nothing
    assert a.missing(0, 9) == 1 and a.missing(0, 100) == 1  # at most max_pages
    freed = _held_pages(a, 1)
    assert a.release(1) == 3 and _held_pages(a, 1) == [] and a.free_pages == 3
    assert a.grow(0, 9) and a.held(0) == 3 and a.free_pages == 2
    assert len(set(_held_pages(a, 0)) & set(freed)) == 1  # its new page is a freed one


def test_paged_config_validation():
    for key, value in [("kv_layout", "ragged"), ("page_size", 0), ("page_size", 512),
                       ("kv_memory_fraction", 1.5)]:
        cfg = engine_config()
        cfg.update({"kv_layout": "paged", key: value})
        with pytest.raises(ConfigError, match=rf"^engine\.{key}:"):
            validate_engine_config(cfg)
    with pytest.raises(ConfigError, match=r"^engine\.kv_memory_fraction:.*kv_layout"):
        validate_engine_config(_cfg(kv_memory_fraction=0.5))
    with pytest.raises(ConfigError, match=r"^engine\.kv_memory_fraction:.*set one"):
        validate_engine_config(_cfg(kv_layout="paged", kv_memory_fraction=0.5,
                                    kv_budget_tokens=1024))


def _cfg(**kw):
    cfg = engine_config()
    cfg.update(kw)
    return cfg


def test_pool_sizing_and_memory_check():
    cfg = tiny_config()
    pool = init_paged_cache(cfg, 7, 16)
    assert engine_memory.paged_cache_bytes(cfg, 7, 16, jnp.float32) == sum(
        x.nbytes for x in jax.tree.leaves(pool))
    page = engine_memory.page_bytes(cfg, 16, jnp.float32)
    weights = engine_memory.weight_bytes(cfg, jnp.float32)
    free = weights + 100 * page
    assert engine_memory.pool_pages_for_memory(cfg, 16, jnp.float32, 0.5, jax.devices()[:1],
                                               available=free) == 50
    with pytest.raises(ConfigError, match=r"^engine\.kv_memory_fraction:"):
        engine_memory.pool_pages_for_memory(cfg, 16, jnp.float32, 0.001, jax.devices()[:1],
                                            available=free)
    with pytest.raises(ConfigError, match=r"^engine\.kv_budget_tokens:.*at most 80 pages"):
        engine_memory.check_fits(cfg, 8, 256, jnp.float32, jax.devices()[:1],
                                 available=int((weights + 80.5 * page) / 0.9), pages=(81, 16))


def test_engine_sizes_its_pool_from_free_memory(models, monkeypatch):
    """kv_memory_fraction: the pool is that share of what the weights leave free (the
    measurement pinned here), whatever max_slots x max_seq_len would take."""
    cfg = models[0].cfg
    page = engine_memory.page_bytes(cfg, 8, jnp.float32)
    weights = engine_memory.weight_bytes(cfg, jnp.float32)
    monkeypatch.setattr(engine_memory, "free_bytes", lambda devices: weights + 400 * page)
    eng = make_engine(models[0], max_slots=64, kv_memory_fraction=0.05, **PAGED)
    assert eng.stats()["kv_pages_total"] == 20 and eng.stats()["kv_budget_tokens"] == 160
    assert eng.memory["kv_cache_bytes"] == 20 * page  # dense would be 64 x 64 tokens
    c = eng.generate([request("m", [1, 2, 3], max_new_tokens=20, seed=0)])[0]
    assert len(c.token_ids) == 20
    with pytest.raises(ConfigError, match=r"^engine\.kv_memory_fraction:.*pages fit"):
        make_engine(models[0], kv_memory_fraction=0.99, **PAGED)  # no headroom left
