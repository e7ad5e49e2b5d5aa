"""JaxEngine determinism: a batch handed over whole (`submit_batch`) to an idle engine is
sampled bit for bit the same whatever the timing of the engine's loop thread and of its
consumer, because the engine's schedule (admission order, prefill batches, slots, decode
chunks) is then a function of the batch alone. Lock-step runs (lag injection, sync) rely on
this for bit-identical repeats (tests/reliability/test_determinism_and_security.py).

The shape here (8 slots, prefill batches of up to 4) is one where the schedule shows in the
last bits: XLA:CPU's matmuls round differently for another prefill batch size, so the same
requests arriving one at a time get other log-prob bits (checked below, so the exact
comparisons cannot pass vacuously)."""
import dataclasses
import random
import time

import numpy as np
import pytest

from tests.rollout.conftest import make_engine, random_requests

SHAPE = dict(max_slots=8, max_prefill_batch=4)
def _two_samples_each(requests):
    return [dataclasses.replace(r, params=dataclasses.replace(r.params, n=2)) for r in requests]


REQUESTS = random_requests(8, seed=11, lognormal=(2.2, 0.6), stop_token_ids=(7,)) + \
    _two_samples_each(random_requests(3, seed=12, temperature=0.8, top_k=9))
TOTAL = sum(r.params.n for r in REQUESTS)


def _drain_by_steps(engine, outs):
    while len(outs) < TOTAL:
        engine.step()
        for c in engine.get_completions():
            outs[(c.request_id, c.sample_index)] = c
    return outs


@pytest.fixture(scope="module")
def reference(models):
    """The whole batch through an engine the test steps itself (no thread)."""
    engine = make_engine(models[0], **SHAPE)
    engine.submit_batch(REQUESTS)
    outs = _drain_by_steps(engine, {})
    engine.close()
    return outs


def _assert_identical(expected, got):
    assert expected.keys() == got.keys()
    for k, e in expected.items():
        g = got[k]
        np.testing.assert_array_equal(g.token_ids, e.token_ids, err_msg=str(k))
        assert g.logp_behaviour.tobytes() == e.logp_behaviour.tobytes(), k  # every bit
        np.testing.assert_array_equal(g.version, e.version)
        assert (g.finish_reason, g.start_version) == (e.finish_reason, e.start_version)


def test_arrival_interleaving_changes_the_last_bits(models, reference):
    """Not vacuous: the same requests arriving one at a time (a step between arrivals, as
    a worker submitting one by one meets a running loop) are batched differently and get
    other log-prob bits; the tokens agree."""
    engine = make_engine(models[0], **SHAPE)
    outs = {}
    for r in REQUESTS:
        engine.submit(r)
        engine.step()
        for c in engine.get_completions():
            outs[(c.request_id, c.sample_index)] = c
    _drain_by_steps(engine, outs)
    engine.close()
    assert all(np.array_equal(outs[k].token_ids, c.token_ids) for k, c in reference.items())
    assert any(outs[k].logp_behaviour.tobytes() != c.logp_behaviour.tobytes()
               for k, c in reference.items())


@pytest.mark.parametrize("jitter_seed", [0, 1, 2])
def test_whole_batch_is_bit_identical_whatever_the_thread_timing(models, reference,
                                                                 jitter_seed):
    """The loop thread runs on its own while the consumer polls at random moments, pauses
    and resumes the engine, and reads stats: nothing of that reaches the samples."""
    rng = random.Random(jitter_seed)
    engine = make_engine(models[0], start=True, **SHAPE)
    try:
        time.sleep(rng.uniform(0, 0.02))  # the loop thread is idle, waiting for work
        engine.submit_batch(REQUESTS)
        outs, deadline = {}, time.monotonic() + 120
        while len(outs) < TOTAL and time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.2:
                engine.pause()
                time.sleep(rng.uniform(0, 0.01))
                engine.resume()
            elif roll < 0.3:
                engine.stats()
            else:
                time.sleep(rng.uniform(0, 0.005))
            for c in engine.get_completions(timeout=rng.uniform(0, 0.01),
                                            max_items=rng.randint(1, 4)):
                outs[(c.request_id, c.sample_index)] = c
    finally:
        engine.close()
    _assert_identical(reference, outs)


def test_generate_with_a_loop_thread_matches_the_stepped_engine(models, reference):
    """`generate` hands its requests over whole too."""
    engine = make_engine(models[0], start=True, **SHAPE)
    try:
        outs = {(c.request_id, c.sample_index): c for c in engine.generate(REQUESTS, timeout=120)}
    finally:
        engine.close()
    _assert_identical(reference, outs)


def test_submit_batch_is_all_or_nothing(models):
    from pipelinerl_jax.rollout.engine import RequestError
    from tests.rollout.conftest import request
    engine = make_engine(models[0], **SHAPE)
    good = request("ok", [1, 2, 3], max_new_tokens=4)
    with pytest.raises(RequestError, match="appears twice"):
        engine.submit_batch([good, request("ok", [4], max_new_tokens=4)])
    with pytest.raises(RequestError, match="bad"):
        engine.submit_batch([good, request("bad", [], max_new_tokens=4)])
    assert engine.stats()["queued_samples"] == 0  # nothing of a refused batch was queued
    engine.submit_batch([good])
    with pytest.raises(RequestError, match="already in flight"):
        engine.submit_batch([request("other", [5], max_new_tokens=4), good])
    assert engine.stats()["queued_requests"] == 1
    engine.close()
