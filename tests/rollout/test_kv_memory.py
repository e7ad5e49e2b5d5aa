"""The KV-memory interface (`rollout/kv_memory.py`) pinned on both implementations: one script
of admit / grow / release (retain) / a shared group prompt / a retained prefix / a victim, run
on `DenseKV` and on `PagedKV`, the way the scheduler drives them. Both admit the same samples
in the same order and, for each, leave the K/V of exactly the same token positions written
(mapped or prefilled: equal tokens); the paged one holds no more pages than its samples'
positions need (a shared prompt's pages counted once) and, released, keeps only the prefix
cache's pages, which it gives back on demand; the dense one's reservations return to 0.
Engine-level equality of the two layouts' tokens: test_paged_engine.py, test_paged_share.py,
test_paged_reuse.py."""
import numpy as np
import pytest

from pipelinerl_jax.rollout.jax_scheduler import Sample
from pipelinerl_jax.rollout.kv_memory import DenseKV, PagedKV, chunk_end
from pipelinerl_jax.rollout.page_allocator import PageAllocator, pages_for
from pipelinerl_jax.records import GenerationRequest, SamplingParams

C, SLOTS, STEPS, MAX_LEN = 4, 4, 4, 64


def _sample(rid, prompt, n=1, index=0, max_new=8, order=0):
    prompt = np.asarray(prompt, np.int32)
    req = GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, n=n))
    return Sample(req, index, prompt, seed=0, limit=len(prompt) + max_new, submit_time=0.0,
                  order=order)


def _kv(kind, num_pages=64):
    if kind == "dense":
        return DenseKV(SLOTS, budget=SLOTS * MAX_LEN)
    return PagedKV(PageAllocator(num_pages, C, SLOTS, pages_for(MAX_LEN, C)), STEPS,
                   prefix_cache=True, reuse_max_lag=0, rows=(SLOTS,))


def _written(admission, s):
    """(the tokens whose K/V exist once the admission's prefill or start ran: the mapped
    `seq[:start]` plus the prefilled rest; whether it started on its group's shared prompt,
    which holds the prompt but its last token: the pending one, its first decode writes)."""
    if admission.start is not None:
        assert admission.start[0] is s
        return [int(t) for t in s.prompt[:-1]], True
    _, _, seq, start = admission.prefill
    return [int(t) for t in seq[:start]] + [int(t) for t in seq[start:]], False


def _generate(s, tokens):
    s.tokens.append(np.asarray(tokens, np.int32))
    s.n_generated += len(tokens)


def _script(kind):
    """The script; returns (per admitted sample: (name, written positions' tokens)), the
    KV memory and the pages bound the paged one must respect at its peak."""
    kv, out, slots = _kv(kind), [], [None] * SLOTS
    a = _sample("a", np.arange(1, 14), order=0)  # 13 tokens
    b0, b1 = (_sample("b", [7, 7, 8, 9, 10, 11], n=2, index=i, order=1 + i) for i in range(2))
    for slot, s in enumerate((a, b0, b1)):
        kv.open_round([(i, x) for i, x in enumerate(slots) if x is not None])
        adm = kv.admit(s, slot, version=0)
        assert adm is not None and adm.kv_version == 0
        slots[slot], s.kv_version = s, adm.kv_version  # (as the scheduler records them)
        out.append((f"{s.request.request_id}{s.index}", _written(adm, s)))
    for i in (0, 1, 2):  # one decode chunk's growth, then tokens generated
        assert kv.grow(i, chunk_end(slots[i], slots[i].pos, STEPS))
    _generate(a, [20, 21, 22, 23])
    peak = sum(pages_for(chunk_end(s, s.pos, STEPS), C) for s in (a, b0)) + \
        pages_for(chunk_end(b1, b1.pos, STEPS), C) - (len(b0.prompt) - 1) // C
    held = kv.pages.used_pages if kind == "paged" else None
    assert kv.victim(slots) == 2  # the youngest running sample
    kv.release(a, 0, retain=True)  # finished: its written full pages are kept (paged)
    slots[0] = None
    # the next turn of `a`: its sequence + the environment's tokens
    c = _sample("c", np.concatenate([a.sequence(), [30, 31, 32]]), order=3)
    kv.open_round([(i, x) for i, x in enumerate(slots) if x is not None])
    adm = kv.admit(c, 0, version=0)
    assert adm is not None
    out.append(("c0", _written(adm, c)))
    slots[0] = c
    for i, s in enumerate(slots):
        if s is not None:
            kv.release(s, i, retain=False)
    return out, kv, peak, held, adm


@pytest.fixture(scope="module")
def scripts():
    return {kind: _script(kind) for kind in ("dense", "paged")}


def test_both_write_the_same_tokens_for_the_same_admissions(scripts):
    dense, paged = scripts["dense"][0], scripts["paged"][0]
    assert [n for n, _ in dense] == [n for n, _ in paged] == ["a0", "b0", "b1", "c0"]
    for (name, (d, d_shared)), (_, (p, p_shared)) in zip(dense, paged):
        assert not d_shared
        # a group's sample on its shared prompt: the same tokens but the pending last one,
        # which its first decode step writes (where the dense prefill wrote it)
        assert p_shared == name.startswith("b")
        assert p == (d[:-1] if p_shared else d), name


def test_paged_shares_the_prompt_and_reuses_the_retained_prefix(scripts):
    _, kv, peak, held, adm_c = scripts["paged"]
    assert held <= peak  # the group's full prompt pages counted once
    _, _, seq, start = adm_c.prefill
    assert start == 16  # a's 4 full written pages were mapped, only the rest prefilled
    assert adm_c.stats["prefix_cache_hits"] == 1 and adm_c.stats["reused_tokens"] == 16
    # released: only the prefix cache holds pages, and it gives them back on demand
    assert kv.pages.used_pages == len(kv.retained) > 0
    assert kv.pages.available == kv.pages.num_pages
    for row in range(SLOTS):  # 4 rows x 16 pages: the whole pool, the cache's pages too
        assert kv.grow(row, MAX_LEN)
    assert kv.pages.free_pages == 0 and len(kv.retained) == 0


def test_dense_reservations_return_to_zero(scripts):
    _, kv, _, _, adm_c = scripts["dense"]
    assert kv.reserved == 0 and adm_c.prefill[3] == 0  # dense maps nothing, prefills all
    assert kv.figures({})["kv_tokens_reserved"] == 0


def test_short_memory_refuses_then_a_victim_frees_it():
    """Head-of-line: a sample that does not fit is refused with nothing held (both); paged
    growth fails when the pool is dry and succeeds once the victim is released."""
    dense = DenseKV(SLOTS, budget=30)
    big = _sample("x", np.arange(1, 21), max_new=8)  # reserves 28
    assert dense.admit(big, 0, 0) is not None
    assert dense.admit(_sample("y", [1, 2, 3], max_new=8), 1, 0) is None
    assert dense.reserved == 28
    paged = _kv("paged", num_pages=6)
    s0, s1 = _sample("p", np.arange(1, 9), order=0), _sample("q", np.arange(1, 9), order=1)
    for slot, s in enumerate((s0, s1)):
        paged.open_round([])
        assert paged.admit(s, slot, 0) is not None
    slots = [s0, s1, None, None]
    assert not paged.grow(0, 24)  # needs 4 more pages, 2 of the 6 are free
    victim = paged.victim(slots)
    assert victim == 1
    paged.release(s1, victim, retain=False)
    assert paged.grow(0, 24) and paged.pages.held(0) == 6
