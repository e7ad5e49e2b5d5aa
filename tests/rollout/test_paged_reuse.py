"""Prefix reuse in the paged JaxEngine (`rollout/prefix_cache.py`, the `extend` program):
multi-turn episodes map their earlier turns' pages and prefill only the new tokens, a
preempted sample of a group re-prefills only its private tokens, retained pages never cost
admission a sample, and tokens, log-probs and provenance stay those of the engine without
reuse (and of the dense engine), or of a per-position replay where 'keep' reuses older K/V."""
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.rollout.jax_engine import engine_config, validate_engine_config
from pipelinerl_jax.rollout.page_allocator import PageAllocator
from pipelinerl_jax.rollout.prefix_cache import PrefixCache
from tests.rollout.conftest import make_engine, request, run_until
from tests.rollout.test_paged_share import _check_refcounts, _replay

C = 8
PAGED = dict(kv_layout="paged", page_size=C)


def _tokens(length, seed):
    return np.random.default_rng(seed).integers(1, 64, length).astype(np.int32)


def _episodes(eng, n_episodes=3, turns=3, sampled=True, between=None, top_p=0.9):
    """Runs `n_episodes` multi-turn episodes side by side, the way `envs/runner.py` does:
    turn k's prompt is turn k-1's prompt + its completion + 4 environment tokens. Returns
    {(episode, turn): completion} and the engine's `prefill_tokens` per turn (all episodes).
    `between(eng, turn)` runs before each turn after the first (a weight update); `top_p`
    1 makes the log-probs full-softmax ones (the oracles' kind)."""
    prompts = {e: _tokens(5 + 3 * e, 50 + e) for e in range(n_episodes)}
    out, prefilled = {}, []
    for k in range(turns):
        if k and between is not None:
            between(eng, k)
        before = eng.stats()["prefill_tokens"]
        for e in range(n_episodes):
            params = dict(temperature=1.0, top_p=top_p) if sampled else dict(temperature=0.0)
            eng.submit(request(f"e{e}/t{k}", prompts[e], max_new_tokens=6 + e, seed=7 * e + k,
                               **params))
        for c in run_until(eng, n_episodes):
            e = int(c.request_id[1:c.request_id.index("/")])
            out[(e, k)] = c
            prompts[e] = np.concatenate([prompts[e], c.token_ids, _tokens(4, 100 * e + k)])
        prefilled.append(eng.stats()["prefill_tokens"] - before)
        if eng.pages is not None:
            _check_refcounts(eng)
    return out, prefilled


def _assert_same(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key].token_ids, b[key].token_ids, err_msg=str(key))
        np.testing.assert_allclose(a[key].logp_behaviour, b[key].logp_behaviour, atol=atol,
                                   err_msg=str(key))
        np.testing.assert_array_equal(a[key].kv_version, b[key].kv_version)


@pytest.mark.parametrize("sampled", [False, True])
def test_multi_turn_prefills_only_new_tokens_and_equals_no_reuse_and_dense(models, sampled):
    dense, _ = _episodes(make_engine(models[0]), sampled=sampled)
    off, prefilled_off = _episodes(make_engine(models[0], prefix_cache=False, **PAGED),
                                   sampled=sampled)
    eng = make_engine(models[0], **PAGED)
    on, prefilled_on = _episodes(eng, sampled=sampled)
    _assert_same(dense, on)
    _assert_same(off, on)
    # without reuse every turn prefills its whole prompt; with it, turn k > 0 prefills only
    # what turn k-1 did not write into full pages: its last partial page and the new tokens
    for k in range(3):
        want = sum(len(on[(e, k)].prompt_ids) for e in range(3))
        assert prefilled_off[k] == want
        if k:
            written = [len(on[(e, k - 1)].prompt_ids) + len(on[(e, k - 1)].token_ids) - 1
                       for e in range(3)]
            want = sum(len(on[(e, k)].prompt_ids) - C * (w // C) for e, w in enumerate(written))
            new = sum(len(on[(e, k)].prompt_ids) - w for e, w in enumerate(written))
            assert prefilled_on[k] == want and new <= want < new + 3 * C
    assert prefilled_on[0] == prefilled_off[0]
    s = eng.stats()
    assert s["prefix_cache_hits"] == 6  # every episode's turns 2 and 3
    assert s["reused_tokens"] == sum(prefilled_off) - sum(prefilled_on)
    assert s["prefix_cache_pages"] > 0 and s["kv_pages_free"] == s["kv_pages_total"]
    assert eng.stats()["compiled_programs"] == s["compiled_programs"]


def test_recompute_update_between_turns_drops_the_cache(models, reference):
    """'recompute': a weight update before turn 2 invalidates every retained page (turn 2
    prefills its whole prompt with the new weights: no hit), turn 3 reuses turn 2's pages;
    every token's kv_version is its version and its log-probs are that version's full
    forward, as without reuse."""
    def update(eng, k):
        if k == 1:
            eng.update_weights(models[1], 1)

    off, _ = _episodes(make_engine(models[0], prefix_cache=False, kv_policy="recompute",
                                   **PAGED), between=update, top_p=1.0)
    eng = make_engine(models[0], kv_policy="recompute", **PAGED)
    on, prefilled = _episodes(eng, between=update, top_p=1.0)
    _assert_same(off, on)
    assert prefilled[1] == sum(len(on[(e, 1)].prompt_ids) for e in range(3))
    assert eng.stats()["prefix_cache_hits"] == 3  # turn 3 only
    for (e, k), c in on.items():
        np.testing.assert_array_equal(c.kv_version, c.version)
        np.testing.assert_allclose(c.logp_behaviour, reference(
            models[min(k, 1)], c.prompt_ids, c.token_ids), atol=1e-4)


def test_keep_update_between_turns_reuses_older_pages_with_exact_provenance(models):
    """'keep' with prefix_cache_max_lag=1: turn 2 after an update maps turn 1's pages,
    written by version 0: its tokens report version 1, kv_version 0, and their log-probs are
    a forward whose K/V below the mapped pages came from version 0 and the rest from version
    1 (a per-position replay), not version 1's full forward (what the engine without reuse
    computes). With the default max lag 0, turn 2 reuses nothing and equals no reuse."""
    def update(eng, k):
        if k == 1:
            eng.update_weights(models[1], 1)

    off, _ = _episodes(make_engine(models[0], prefix_cache=False, **PAGED), turns=2,
                       between=update, top_p=1.0)
    fresh = make_engine(models[0], **PAGED)  # prefix_cache_max_lag 0: too old to reuse
    same, prefilled = _episodes(fresh, turns=2, between=update, top_p=1.0)
    _assert_same(off, same)
    assert fresh.stats()["prefix_cache_hits"] == 0
    assert prefilled[1] == sum(len(same[(e, 1)].prompt_ids) for e in range(3))
    eng = make_engine(models[0], prefix_cache_max_lag=1, **PAGED)
    on, _ = _episodes(eng, turns=2, between=update, top_p=1.0)
    assert eng.stats()["prefix_cache_hits"] == 3
    for e in range(3):
        c, prev = on[(e, 1)], on[(e, 0)]
        assert (c.version == 1).all() and (c.kv_version == 0).all()
        mapped = C * ((len(prev.prompt_ids) + len(prev.token_ids) - 1) // C)
        seq = np.concatenate([c.prompt_ids, c.token_ids])
        writers = np.r_[np.zeros(mapped, int), np.ones(len(seq) - mapped, int)]
        np.testing.assert_allclose(c.logp_behaviour,
                                   _replay(models, seq, writers)[len(c.prompt_ids) - 1:],
                                   atol=1e-4, err_msg=f"episode {e}")
        assert not np.allclose(c.logp_behaviour, off[(e, 1)].logp_behaviour, atol=1e-3)
        np.testing.assert_array_equal(off[(e, 1)].kv_version, 1)


def test_preempted_group_sample_re_prefills_only_its_private_tokens(models):
    """A 10-page pool, groups sharing prompts: samples preempted after they generated tokens
    are readmitted onto their group's live prompt pages (no prefix cache here: the reuse is
    the group's) and prefill only their private part over them, with the dense engine's
    tokens and log-probs."""
    prompt = _tokens(17, 9)  # prefix of 16 positions: 2 full shared pages
    reqs = [request("long", prompt, max_new_tokens=30, n=4, seed=8, temperature=1.0),
            request("g", _tokens(12, 3), max_new_tokens=25, n=4, seed=2, temperature=0.0)]
    runs = {}
    for name, cfg in [("dense", {}), ("paged", dict(kv_budget_tokens=80,
                                                    prefix_cache=False, **PAGED))]:
        eng = make_engine(models[0], **cfg)
        for r in reqs:
            eng.submit(r)
        runs[name] = {(c.request_id, c.sample_index): c for c in run_until(eng, 8)}
        if name == "paged":
            _check_refcounts(eng)
            s = eng.stats()
    for key, d in runs["dense"].items():
        np.testing.assert_array_equal(runs["paged"][key].token_ids, d.token_ids)
        np.testing.assert_allclose(runs["paged"][key].logp_behaviour, d.logp_behaviour,
                                   atol=1e-5)
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0
    # each rejoin mapped its group's full prompt pages instead of prefilling them
    assert s["reused_tokens"] % C == 0 and s["reused_tokens"] >= C * s["prefix_cache_hits"]
    assert s["kv_pages_free"] == s["kv_pages_total"] == 10


def _admitted(eng, reqs):
    for r in reqs:
        eng.submit(r)
    eng.step()
    s = eng.stats()
    return s["active_slots"], s["preemptions"]


@pytest.mark.parametrize("fill", [4, 12])
def test_retained_pages_never_reduce_what_the_pool_admits(models, fill):
    """An 8-page pool: after `fill` finished requests left their pages in the prefix cache
    (up to the whole pool), fresh requests are admitted exactly as on an engine that keeps
    nothing (retained pages are evicted first), and the run that follows is the same."""
    fresh = [request(f"n{i}", _tokens(14, 300 + i), max_new_tokens=12, seed=i,
                     temperature=0.0) for i in range(4)]
    base = make_engine(models[0], kv_budget_tokens=64, prefix_cache=False, **PAGED)
    want = _admitted(base, fresh)
    eng = make_engine(models[0], kv_budget_tokens=64, **PAGED)
    for i in range(fill):
        eng.submit(request(f"old{i}", _tokens(15, 400 + i), max_new_tokens=4, seed=i,
                           temperature=0.0))
    run_until(eng, fill)
    s = eng.stats()
    # (some pages were evicted already while the old requests competed for the pool)
    assert s["prefix_cache_pages"] >= 6 and s["kv_pages_free"] == 8
    assert _admitted(eng, fresh) == want
    assert want[0] >= 2
    assert eng.stats()["prefix_cache_evictions"] > 0
    _check_refcounts(eng)
    a = {c.request_id: c for c in run_until(base, 4)}
    b = {c.request_id: c for c in run_until(eng, 4)}
    for rid in a:
        np.testing.assert_array_equal(a[rid].token_ids, b[rid].token_ids)
    assert base.stats()["preemptions"] == eng.stats()["preemptions"]


def test_prefix_cache_lru_eviction_and_holds():
    pages = PageAllocator(num_pages=8, page_size=2, num_rows=2, max_pages=4)
    cache = PrefixCache(pages)
    assert pages.grow(0, 6) and pages.pages(0) == [0, 1, 2]
    seq_a = [1, 2, 3, 4, 5, 6]
    assert cache.insert(seq_a, [0, 1, 2], version=3) == 3
    pages.release(0)  # finished: only the cache holds pages 0-2
    assert pages.free_pages == 5 and pages.available == 8 and cache.evictable() == 3
    assert pages.grow(1, 4) and pages.pages(1) == [3, 4]
    assert cache.insert([1, 2, 9, 9], [3, 4], version=4) == 0  # same first tokens: a
    pages.release(1)  # different page holds them already (page 3 is not retained)
    assert len(cache) == 3 and pages.free_pages == 5
    # a lookup maps the longest retained path, page by page, never past `max_pages`
    assert [n.page for n in cache.match([1, 2, 3, 4, 7, 7], 3)] == [0, 1]
    assert [n.page for n in cache.match(seq_a, 2)] == [0, 1]
    assert cache.match([1, 2, 3, 4], 2, min_version=4) == []  # too old for 'recompute'
    pages.share(0, [0, 1])  # a running sample maps pages 0, 1: only page 2 is evictable
    assert cache.evictable() == 1
    assert cache.evict(3) == 1 and pages.refs[2] == 0 and len(cache) == 2
    pages.release(0)
    assert cache.evictable() == 2
    # grow takes the cache's pages when the free list is short (leaves first)
    assert pages.grow(1, 8) and pages.free_pages == 2 and len(cache) == 2
    assert pages.grow(0, 8) and pages.free_pages == 0 and len(cache) == 0
    assert cache.evictions == 3


def test_prefix_cache_lru_order():
    pages = PageAllocator(num_pages=4, page_size=1, num_rows=1, max_pages=4)
    cache = PrefixCache(pages)
    for tokens in ([1], [2], [3]):
        pages.grow(0, 1)
        cache.insert(tokens, pages.pages(0), version=0)
        pages.release(0)
    cache.match([1], 1)  # [1] used last: [2] is the least recently used
    assert cache.evict(1) == 1
    assert cache.match([2], 1) == [] and len(cache.match([1], 1)) == 1
    assert len(cache.match([3], 1)) == 1


def test_prefix_cache_config_key_is_validated():
    cfg = engine_config().to_dict()  # (a ConfigDict refuses a non-bool already)
    cfg["prefix_cache"] = "yes"
    with pytest.raises(ConfigError, match=r"^engine\.prefix_cache:.*True or False"):
        validate_engine_config(cfg)
    cfg["prefix_cache"] = False
    validate_engine_config(cfg)
    for bad in (-1, 1.5):
        with pytest.raises(ConfigError, match=r"^engine\.prefix_cache_max_lag:"):
            validate_engine_config({**cfg, "prefix_cache_max_lag": bad})
    with pytest.raises(ConfigError, match=r"^engine\.prefix_cache_max_lag:.*keep"):
        validate_engine_config({**cfg, "prefix_cache_max_lag": 2, "kv_policy": "recompute"})
    validate_engine_config({**cfg, "prefix_cache_max_lag": 2})


def test_multi_turn_in_a_tiny_pool_evicts_preempts_and_still_equals_dense(models):
    """Episodes whose histories outgrow a 10-page pool: retained pages are evicted, samples
    preempted and readmitted (onto retained pages where they survived); every reference
    count adds up after each turn and the tokens and log-probs are the dense engine's."""
    dense, _ = _episodes(make_engine(models[0]), n_episodes=4, sampled=True)
    eng = make_engine(models[0], kv_budget_tokens=80, **PAGED)
    paged, _ = _episodes(eng, n_episodes=4, sampled=True)
    _assert_same(dense, paged)
    s = eng.stats()
    assert s["prefix_cache_hits"] > 0 and s["prefix_cache_evictions"] > 0
    assert s["preemptions"] > 0 and s["kv_pages_free"] == 10


def test_a_group_prompt_seen_before_maps_its_retained_pages(models):
    """A group (n = 4) whose prompt an earlier, finished group had: the new group's prefix
    maps the retained full pages and prefills only its partial page (nothing when the
    prefix ends on a page boundary), with the dense engine's tokens and log-probs."""
    reqs = []
    for g, length in enumerate([21, 17]):  # prefixes of 20 (2 full pages + 4) and 16 (2)
        prompt = _tokens(length, 60 + g)
        for rep in range(2):
            reqs.append(request(f"g{g}r{rep}", prompt, max_new_tokens=10, n=4, seed=rep,
                                temperature=1.0))
    dense, paged = make_engine(models[0]), make_engine(models[0], max_slots=8, **PAGED)
    for r in reqs:  # one group at a time: the second of each prompt finds the first's pages
        a = {c.sample_index: c for c in (dense.submit(r) or run_until(dense, 4))}
        before = paged.stats()["prefill_tokens"]
        b = {c.sample_index: c for c in (paged.submit(r) or run_until(paged, 4))}
        _check_refcounts(paged)
        pre = len(r.prompt_ids) - 1
        again = r.request_id.endswith("r1")
        assert paged.stats()["prefill_tokens"] - before == (pre % C if again else pre)
        for i in range(4):
            np.testing.assert_array_equal(b[i].token_ids, a[i].token_ids)
            np.testing.assert_allclose(b[i].logp_behaviour, a[i].logp_behaviour, atol=1e-5)
    s = paged.stats()
    assert s["prefix_cache_hits"] == 2 and s["reused_tokens"] == 32
    assert s["prompt_prefills"] == 4  # one per group, as before (a mapped one counts)
