"""The fast engine pool against a brute-force loop over every decode step."""
import math

import numpy as np
import pytest

from pipelinerl_jax.sim.engines import EnginePool
from pipelinerl_jax.sim.hardware import ACCELERATORS, MODELS
from pipelinerl_jax.sim.latency import DecodeLatency
from pipelinerl_jax.sim.lengths import Empirical, LogNormal

LAT = DecodeLatency.roofline(ACCELERATORS["h100"], MODELS["qwen2.5-7b"])
P = 64


def _brute_force_drain(lengths, prefill_tokens):
    """One engine, every sample admitted at step 0: per-step B and C, summed step by step."""
    lengths = np.sort(lengths)
    t, finish = LAT.prefill_time(prefill_tokens * lengths.size), {}
    for n in range(int(lengths.max())):
        running = lengths > n
        t += LAT.step_time(running.sum(), (P + n) * running.sum())
        for L in lengths[lengths == n + 1]:
            finish.setdefault(int(L), t)
    return np.array([finish[int(L)] for L in lengths])


@pytest.mark.parametrize("max_len", [50, 3000])
def test_drain_matches_step_by_step_loop(max_len):
    # 50 steps fit in one grid bin per step (exact); 3000 steps use 47-step bins.
    dist = LogNormal(median=max_len / 6, tail=max_len / 1.5, max_len=max_len)
    pool = EnginePool(1, 40, LAT, dist, P, group_size=4, rng=np.random.default_rng(3))
    pool.set_group_cap(10)  # 40 samples for 40 slots: all start at step 0
    sids, t_adm, lens, fin, t_fin = pool.advance(math.inf)
    assert sids.size == 40 and np.all(t_adm == 0)
    got = np.sort(t_fin)
    want = _brute_force_drain(lens, P)
    rel = 1e-12 if max_len <= pool.grid_bins else 2e-3
    np.testing.assert_allclose(got, want, rtol=rel)


def test_continuous_batching_refills_slots_in_waves():
    # Constant lengths: 3 waves of S samples, each wave L steps at batch S.
    S, L = 8, 30
    pool = EnginePool(2, S, LAT, Empirical([L]), P, group_size=2, rng=np.random.default_rng(0),
                      prefill_tokens_per_sample=0.0)
    pool.set_group_cap(2 * 3 * S // 2)  # 3 waves per engine
    sids, t_adm, lens, fin, t_fin = pool.advance(math.inf)
    assert sids.size == fin.size == 2 * 3 * S
    wave = [sum(LAT.step_time(S, S * (P + n)) for n in range(L))]
    # Later waves start with fresh caches too (each new sample brings only its prompt).
    expect = np.cumsum(wave * 3)
    for e in range(2):
        mine = np.sort(t_fin[(fin // 2) % 2 == e])
        np.testing.assert_allclose(mine, np.repeat(expect, S), rtol=1e-12)


def test_horizon_cut_carries_sequences_over_and_respects_slots():
    dist = LogNormal(median=200, tail=2000, max_len=4096)
    S, E = 16, 3
    pool = EnginePool(E, S, LAT, dist, P, group_size=4, rng=np.random.default_rng(7))
    pool.set_group_cap(np.inf)
    adm, fins = [], []
    for h in np.linspace(0.5, 20, 40):
        out = pool.advance(h)
        assert np.all(pool.clock >= h - 1e-9) and np.all(pool.clock < h + 0.05)
        adm.append(out[:3])
        fins.append(out[3:])
    sid = np.concatenate([a[0] for a in adm])
    t0 = np.concatenate([a[1] for a in adm])
    ln = np.concatenate([a[2] for a in adm])
    fin = np.concatenate([f[0] for f in fins])
    t1 = np.concatenate([f[1] for f in fins])
    assert np.unique(sid).size == sid.size  # every admission is a new sample
    assert set(fin) <= set(sid) and np.unique(fin).size == fin.size
    # Token accounting: finished lengths + progress of the running ones = decoded tokens.
    by_id = dict(zip(sid, ln))
    running = pool.rem > 0
    done_tokens = sum(by_id[s] for s in fin)
    part = sum(by_id[s] for s in pool.sid[running]) - pool.rem[running].sum()
    assert done_tokens + part == pool.decode_tokens
    # Never more than S sequences at once on an engine.
    start = dict(zip(sid, t0))
    eng = (fin // 4) % E
    for e in range(E):
        ev = sorted([(start[s], 1) for s, ee in zip(fin, eng) if ee == e]
                    + [(t, -1) for t, ee in zip(t1, eng) if ee == e])
        assert max(np.cumsum([d for _, d in ev])) <= S
    # Each finished sample took at least its length times the fastest possible step.
    dur = t1 - np.array([start[s] for s in fin])
    assert np.all(dur >= np.array([by_id[s] for s in fin]) * LAT.step_time(1, 0) * (1 - 1e-9))


def test_restore_undoes_an_advance():
    # The driver runs an epoch, undoes it and runs a shorter one (sim/pipeline.py).
    dist = LogNormal(median=200, tail=1500, max_len=3000)
    pool = EnginePool(3, 16, LAT, dist, P, group_size=4, rng=np.random.default_rng(5))
    pool.set_group_cap(30)
    pool.advance(2.0)
    snap = pool.snapshot()
    first = pool.advance(9.0)
    pool.restore(snap)
    again = pool.advance(9.0)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert first[0].size and first[3].size  # it admitted and finished samples
