"""The async queue bound holds per sample.

A finished group is put whole into a queue of `queue.capacity_batches` batches; when it finds
the queue full the put is held and, like the rollout worker, the samplers start nothing until
the learner takes a batch. The oracle here does not use the driver's bookkeeping: it rebuilds
the queue from the engine pool's own record of every admission and finish (what `_collect`
receives) and the learner's step records, and checks it at every admission.
"""
import math

import numpy as np
import pytest

from configs.sim import tiny
from pipelinerl_jax.sim import pipeline
from pipelinerl_jax.sim.sim_config import build_setup, default_config


def _simulate_recorded(setup, monkeypatch):
    """Runs `setup`; returns the result and every (admitted ids, admit times, lengths,
    finished ids, finish times) the engine pool reported, concatenated."""
    record = []
    collect = pipeline._collect

    def spy(store, advanced, version):
        record.append(advanced)
        return collect(store, advanced, version)

    monkeypatch.setattr(pipeline, "_collect", spy)
    result = pipeline.simulate(setup)
    return result, [np.concatenate([a[i] for a in record]) for i in range(5)]


def _waiting_groups(at, finished, finish_t, steps, group_size):
    """Finished groups not yet taken by the learner at each time in `at`. A group finishes
    with its last sample; at one instant a finish comes before an admission (the slot a
    finishing sample frees is the one refilled) and so does a take (the learner takes at the
    start of its step). Assumes no group was dropped (no max_lag)."""
    g = finished // group_size
    n = np.bincount(g)
    last = np.full(n.size, -np.inf)
    np.maximum.at(last, g, finish_t)
    complete = np.sort(last[n == group_size])
    taken = np.r_[0, np.cumsum(steps["samples"] // group_size)]
    return (np.searchsorted(complete, at, side="right")
            - taken[np.searchsorted(steps["start_t"], at, side="right")])


def _samplers_outrun_learner():
    """tiny, 1 sampler / 1 trainer, trained 6x faster than tiny: unbounded, the samplers
    finish ~1.8x the samples the learner trains (rho > 1)."""
    c = tiny.get_config()
    c.steps = 60
    c.devices, c.split.samplers, c.split.trainers = 2, 1, 1
    c.train.flops_per_param_token = 1.0
    c.max_lag = None
    return c


def test_no_sample_starts_while_the_queue_is_full(monkeypatch):
    c = _samplers_outrun_learner()
    c.queue.capacity_batches = None
    free = pipeline.simulate(build_setup(c)).summary()
    assert free["counters"]["finished"] > 1.5 * free["counters"]["trained"]  # rho > 1
    assert free["learner_idle_fraction"] < 0.01

    c.queue.capacity_batches = 1
    s = build_setup(c)
    r, (_, admit_t, _, finished, finish_t) = _simulate_recorded(s, monkeypatch)
    bound = s.batch_size * s.group_size  # samples the queue holds
    assert r.counters["admitted"] == admit_t.size
    waiting = _waiting_groups(admit_t, finished, finish_t, r.steps, s.group_size)
    # At every admission, the samples of finished groups awaiting the learner fit the queue.
    assert waiting.max() * s.group_size <= bound, (
        f"{int((waiting * s.group_size > bound).sum())} of {admit_t.size} samples started "
        f"with up to {waiting.max() / s.batch_size:.2f} batches of finished groups waiting")
    assert waiting.max() * s.group_size == bound  # the bound does bind
    # Samples in flight when the queue fills still finish (their puts wait): staleness
    # stays above one version, but well below the unbounded queue's.
    lag = r.summary()["start_lag_mean_steady"]
    assert 1.0 < lag < 2.5 and lag < free["start_lag_mean_steady"] / 5


def _constant_lengths(capacity: int, steps: int = 10):
    """Deterministic: every response 500 tokens, decode compute-bound and linear in the
    batch, no weight-sync time. 2 engines x 16 slots hold exactly one batch (8 prompts x 4),
    generated in g; a train step takes T = 5g (rho = 5)."""
    c = default_config()
    c.hardware.hbm_bw_gbs = 1e12
    c.latency.sharpness = math.inf
    c.model.heads, c.model.head_dim = 1, 1
    c.lengths.kind = "empirical"
    c.lengths.observed = (500,)
    c.rollout.max_new_tokens = 500
    c.rollout.prompt_len = 0
    c.rollout.concurrency = 16
    c.train.batch_size, c.train.group_size = 8, 4
    # T / g = (32 samples x 500 tokens x 5 FLOPs) / (16 x 500 x 2 FLOPs per engine) = 5
    c.train.flops_per_param_token = 5.0
    c.hardware.train_mfu = c.hardware.mfu = 0.5
    c.train.state_bytes_per_param = 0.0
    c.weight_sync_s = 0.0
    c.devices, c.split.samplers, c.split.trainers = 3, 2, 1
    c.steps, c.warmup_steps = steps, 0
    c.max_lag = None
    c.queue.capacity_batches = capacity
    return c


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_staleness_with_constant_lengths(capacity):
    """Hand-derived. Batch j starts at j·g with version 0 while the queue has room; once
    `capacity` batches wait, the next batch still finishes (in flight when the queue filled)
    and its put is held. From then on, each take at t_k (version k live) frees room for one
    batch, which starts at t_k and finishes at t_k + g < t_{k+1}, then waits behind
    `capacity` others: it is trained at step k + capacity + 1. So step j trains samples of
    start_lag min(j, capacity + 1), every token at that lag too (no version arrives while
    a batch is generated), as long as (capacity + 1)·g <= T."""
    c = _constant_lengths(capacity)
    r = pipeline.simulate(build_setup(c))
    st = r.steps
    g = float(st["start_t"][0])  # the first batch is taken the moment it finishes
    T = float(np.median(st["end_t"] - st["start_t"]))
    assert T == pytest.approx(5 * g, rel=1e-3) and (capacity + 1) * g <= T
    want = np.minimum(np.arange(c.steps), capacity + 1)
    np.testing.assert_allclose(st["start_lag_mean"], want)
    np.testing.assert_array_equal(st["start_lag_max"], want)
    np.testing.assert_allclose(st["lag_mean"], want, atol=1e-9)
    n, k = c.steps, capacity
    mean = (k * (k + 1) / 2 + (k + 1) * (n - k - 1)) / n  # closed form of the whole run
    assert r.summary()["start_lag"]["mean"] == pytest.approx(mean)
    # The learner never waits after its first batch.
    np.testing.assert_allclose(st["start_t"][1:], st["end_t"][:-1])


def test_completions_agree_with_finish():
    from pipelinerl_jax.sim.store import SampleStore
    rng = np.random.default_rng(0)
    st = SampleStore(group_size=4, capacity=4)
    sids = np.arange(40)
    st.admit(sids[:24], np.zeros(24), np.ones(24, np.int64), 0)
    done = rng.permutation(24)[:15]
    st.finish(done, rng.random(15))
    rest = np.setdiff1d(sids, done)  # groups 6-9 not admitted yet: newer than the store
    t = 1 + rng.random(rest.size)
    groups, times = st.completions(rest, t)
    before = (st.n_done.copy(), st.f["finish_t"].copy())
    st.admit(sids[24:], np.zeros(16), np.ones(16, np.int64), 0)
    want_g, want_t = st.finish(rest, t)
    order = np.argsort(want_g)
    np.testing.assert_array_equal(groups, want_g[order])
    np.testing.assert_allclose(times, want_t[order])
    np.testing.assert_array_equal(groups, np.unique(rest // 4))  # each now completes
    assert before[0].sum() == 15  # `completions` recorded nothing
