"""Shared group prompts in the paged JaxEngine (`rollout/prompt_share.py`): the n samples of a
request prefill their prompt once and hold its full pages together (reference counts,
copy-on-write of the partial page), with the dense engine's tokens and log-probs, through
preemption and in-flight updates under kv_policy keep and recompute, with exact provenance."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelinerl_jax.models import init_cache
from pipelinerl_jax.rollout.page_allocator import PageAllocator
from tests.rollout.conftest import REF_LEN, make_engine, request, run_until

PAGED = dict(kv_layout="paged", page_size=8)


def _prompt(length, seed):
    return np.random.default_rng(seed).integers(1, 64, length).astype(np.int32)


def _groups(sampled_stop=False):
    """Groups of n = 4 and 8 whose prompts put the shared prefix (all but the last token) at
    a page boundary (9 -> 8 positions: no partial page), one short of it (8), past it (17 ->
    16: two full pages, and 12), and inside the first page (5); greedy and sampled."""
    out = []
    for g, (length, n) in enumerate([(8, 4), (9, 8), (17, 4), (5, 8), (12, 4)]):
        params = dict(max_new_tokens=12 + 5 * g, n=n, seed=40 + g)
        params.update(dict(temperature=1.0, top_p=0.9) if g % 2 else dict(temperature=0.0))
        if sampled_stop:
            params.update(temperature=1.0, top_p=1.0, stop_token_ids=(7,))
        out.append(request(f"g{g}", _prompt(length, g), **params))
    return out


def _samples(eng, reqs, check=None):
    for r in reqs:
        eng.submit(r)
    want, done = sum(r.params.n for r in reqs), []
    while len(done) < want:
        eng.step()
        done += eng.get_completions()
        if check is not None:
            check(eng)
    return {(c.request_id, c.sample_index): c for c in done}


def _assert_same(dense, paged):
    assert dense.keys() == paged.keys()
    for key, d in dense.items():
        p = paged[key]
        np.testing.assert_array_equal(p.token_ids, d.token_ids, err_msg=str(key))
        np.testing.assert_allclose(p.logp_behaviour, d.logp_behaviour, atol=1e-5,
                                   err_msg=str(key))
        assert p.finish_reason == d.finish_reason


def _check_refcounts(eng):
    """Every page's count is the number of rows listing it plus the prefix cache's hold;
    free pages are those at 0."""
    pages = eng.pages
    counts = np.zeros((pages.num_pages,), np.int32)
    for row in range(eng.num_slots):
        held = pages.pages(row)
        assert len(set(held)) == len(held)
        counts[held] += 1
        assert pages.tables[row, :len(held)].tolist() == held
    counts += pages.retained  # (the prefix cache's holds: pages of finished samples)
    np.testing.assert_array_equal(pages.refs, counts)
    assert pages.free_pages == int((counts == 0).sum())


def test_group_prompt_is_prefilled_once_and_samples_equal_dense(models):
    reqs = _groups()
    dense_eng = make_engine(models[0])
    dense = _samples(dense_eng, reqs)
    eng = make_engine(models[0], max_slots=32, **PAGED)  # every group admitted at once
    paged = _samples(eng, reqs, _check_refcounts)
    _assert_same(dense, paged)
    s, n_samples = eng.stats(), sum(r.params.n for r in reqs)
    assert dense_eng.stats()["prompt_prefills"] == n_samples  # dense: one per sample
    assert s["prompt_prefills"] == len(reqs)  # paged: one per group
    assert s["prefill_tokens"] == sum(len(r.prompt_ids) - 1 for r in reqs)
    assert s["shared_admissions"] == n_samples - len(reqs)
    # copy-on-write of the partial prefix page, for every sibling of a group that has one
    assert s["cow_page_copies"] == sum(r.params.n - 1 for r in reqs
                                       if (len(r.prompt_ids) - 1) % 8)
    assert s["kv_pages_free"] == s["kv_pages_total"] and s["kv_pages_shared"] == 0


def test_shared_pages_are_counted_once_by_admission(models):
    """A 14-page pool: a group of 4 with a 33-token prompt (4 full prefix pages) fits only
    because the 4 samples hold the prefix once (dense-style per-sample prompts would need
    4 x 5 pages before the first decode chunk)."""
    eng = make_engine(models[0], kv_budget_tokens=112, **PAGED)
    eng.submit(request("big", _prompt(33, 5), max_new_tokens=12, n=4, seed=1,
                       temperature=0.0))
    eng.step()
    s = eng.stats()
    assert s["active_slots"] == 4 and s["preemptions"] == 0
    assert s["prompt_prefills"] == 1 and s["kv_pages_shared"] == 4


def test_tiny_pool_preempts_group_siblings_and_still_equals_dense(models):
    """A 10-page pool for groups of 4 and 8: samples of a group are preempted while their
    siblings run on the shared pages (which must stay intact: the siblings' log-probs are the
    dense engine's), re-queued and recomputed; every page comes back."""
    reqs = [request("long", _prompt(17, 9), max_new_tokens=30, n=4, seed=8, temperature=1.0),
            *_groups(sampled_stop=True)]
    dense = _samples(make_engine(models[0]), reqs)
    seen = {"preempted_while_shared": 0}
    eng = make_engine(models[0], kv_budget_tokens=80, **PAGED)

    def check(e):
        _check_refcounts(e)
        s = e.stats()
        assert s["kv_tokens_reserved"] <= s["kv_budget_tokens"]
        if s["preemptions"] > seen.get("preemptions", 0) and s["kv_pages_shared"]:
            seen["preempted_while_shared"] += 1
        seen["preemptions"] = s["preemptions"]

    paged = _samples(eng, reqs, check)
    _assert_same(dense, paged)
    s = eng.stats()
    assert s["preemptions"] > 0 and seen["preempted_while_shared"] > 0
    assert s["shared_admissions"] > 0
    assert s["kv_pages_free"] == 10 and s["kv_pages_shared"] == 0


def test_page_allocator_reference_counts():
    a = PageAllocator(num_pages=6, page_size=4, num_rows=3, max_pages=4)
    assert a.grow(0, 9) and a.pages(0) == [0, 1, 2]
    a.share(1, [0, 1])  # row 1 shares row 0's two full pages, then its own third page
    assert a.grow(1, 10) and a.pages(1) == [0, 1, 3] and a.tables[1].tolist() == [0, 1, 3, 6]
    assert a.refs.tolist() == [2, 2, 1, 1, 0, 0] and a.shared_pages == 2
    assert a.free_pages == 2 and a.used_pages == 4
    assert a.release(0) == 1 and a.free_pages == 3  # only its private page 2 is freed
    assert a.refs.tolist() == [1, 1, 0, 1, 0, 0] and a.tables[0].tolist() == [6] * 4
    assert a.grow(2, 4) and a.pages(2) == [2]  # the freed page is the next one handed out
    assert a.release(1) == 3 and a.free_pages == 5
    try:
        a.share(0, [4])  # a free page cannot be shared
        raise AssertionError("shared a free page")
    except ValueError:
        pass


def _replay(models, seq, writer_versions):
    """Log-probs of `seq[1:]` when position p's forward pass (its K/V and the logits of
    p + 1) ran with `models[writer_versions[p]]`: the cached forward one token at a time."""
    fwd = _replay.fwd
    cache = init_cache(models[0].cfg, 1, REF_LEN)
    out = []
    for p in range(len(seq) - 1):
        logits, cache = fwd(models[int(writer_versions[p])], jnp.asarray([[seq[p]]]),
                            jnp.full((1, 1), p, jnp.int32), cache)
        out.append(logits[0, 0])
    logp = jax.nn.log_softmax(jnp.stack(out), axis=-1)
    return np.asarray(logp[jnp.arange(len(seq) - 1), jnp.asarray(seq[1:])])


_replay.fwd = nnx.jit(lambda m, ids, pos, cache: m(ids, positions=pos, cache=cache))


def test_keep_sibling_admitted_after_an_update_reads_the_older_prefix(models, reference):
    """kv_policy='keep', 3 slots: a short request and two samples of group g run first (g's
    prefix prefilled by version 0); after an update to version 1 the third sample of g is
    admitted onto the same prefix pages (no prefill) and reports kv_version 0 for every
    token, version 1; its log-probs are those of a forward whose prompt K/V came from
    version 0 and everything after from version 1 (not version 1's full forward)."""
    eng = make_engine(models[0], max_slots=3, kv_policy="keep", **PAGED)
    eng.submit(request("x", [5, 6, 7], max_new_tokens=2, seed=9))
    prompt = _prompt(11, 7)
    eng.submit(request("g", prompt, max_new_tokens=20, n=3, seed=3, temperature=1.0))
    eng.step()
    assert eng.stats()["queued_samples"] == 1 and eng.stats()["prompt_prefills"] == 2
    eng.update_weights(models[1], 1)
    done = {(c.request_id, c.sample_index): c for c in eng.get_completions()}
    done.update({(c.request_id, c.sample_index): c for c in run_until(eng, 3)})
    s = eng.stats()
    assert s["prompt_prefills"] == 2 and s["shared_admissions"] == 2  # one prefill for g
    late = done[("g", 2)]
    assert late.start_version == 1
    assert (late.version == 1).all() and (late.kv_version == 0).all()
    pre = len(prompt) - 1
    for i in range(3):
        c = done[("g", i)]
        seq = np.concatenate([prompt, c.token_ids])
        writers = np.concatenate([np.full((pre,), c.kv_version[0]), c.version])
        np.testing.assert_allclose(c.logp_behaviour, _replay(models, seq, writers)[pre:],
                                   atol=1e-4, err_msg=f"sample {i}")
    assert not np.allclose(late.logp_behaviour,
                           reference(models[1], prompt, late.token_ids), atol=1e-3)


def test_recompute_update_rewrites_shared_prompts_with_exact_provenance(models, reference):
    """kv_policy='recompute', groups sharing prefixes in a small pool, an update mid-decode:
    every running sample is re-prefilled by the new version (each shared page written by one
    of its group's rows), every token's kv_version is its version, and its log-probs are that
    version's full forward; siblings admitted after the update share the restamped prefix."""
    eng = make_engine(models[0], kv_budget_tokens=128, kv_policy="recompute", **PAGED)
    reqs = [request(f"h{g}", _prompt(length, 20 + g), max_new_tokens=24, n=3, seed=g,
                    temperature=1.0) for g, length in enumerate([10, 17])]
    for r in reqs:
        eng.submit(r)
    eng.step()
    eng.step()
    assert eng.stats()["kv_pages_shared"] > 0
    eng.update_weights(models[2], 2)
    done = run_until(eng, 6)
    assert eng.stats()["shared_admissions"] >= 3
    for c in done:
        assert len(c.token_ids) == 24
        np.testing.assert_array_equal(c.kv_version, c.version)
        for v in np.unique(c.version):
            at = c.version == v
            np.testing.assert_allclose(c.logp_behaviour[at], reference(
                models[int(v)], c.prompt_ids, c.token_ids)[at], atol=1e-4)
    assert {int(v) for c in done for v in c.version} == {0, 2}
    assert eng.stats()["kv_pages_free"] == 16


def test_recompute_update_reprefills_a_groups_shared_prompt_pages_once(models, reference):
    """'recompute' with a group of 4 on a 25-token prompt (24 prefix positions = 3 full shared
    pages of 8): the update's re-prefill runs one sample's whole sequence and, for each
    sibling, only what follows the shared pages, over them (`extend`) — (25 + g) + 3·(1 + g)
    tokens instead of 4·(25 + g), g tokens sampled before the update — and every token is
    still the new version's full forward."""
    eng = make_engine(models[0], kv_policy="recompute", **PAGED)
    eng.submit(request("big", _prompt(25, 7), max_new_tokens=20, n=4, temperature=0.0))
    eng.step()
    eng.step()
    before = eng.stats()["prefill_tokens"]
    eng.update_weights(models[2], 2)
    eng.step()  # applies the update: the re-prefill, then a decode chunk
    rerun = eng.stats()["prefill_tokens"] - before
    done = run_until(eng, 4)
    g = {int((c.version == 0).sum()) for c in done}
    assert len(g) == 1 and 0 < next(iter(g)) < 20, g  # every sample was mid-answer
    g = g.pop()
    assert rerun == (25 + g) + 3 * (1 + g), (rerun, g)
    for c in done:
        np.testing.assert_array_equal(c.kv_version, c.version)
        for v in np.unique(c.version):
            at = c.version == v
            np.testing.assert_allclose(c.logp_behaviour[at], reference(
                models[int(v)], c.prompt_ids, c.token_ids)[at], atol=1e-4)
