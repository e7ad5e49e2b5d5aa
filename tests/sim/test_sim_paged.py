"""The simulator's paged-admission model (sim/paged.py): a case computed by hand, the real
paged JaxEngine step for step, and the closed form sim_config.py sizes slots with."""
import numpy as np
import pytest

from configs.sim import tiny
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim.sim_config import build_setup
from pipelinerl_jax.sim.lengths import LogNormal
from pipelinerl_jax.sim.paged import (ChunkedEngine, pages_for, paged_concurrency,
                                      paged_tokens_per_sequence)

# Four requests of prompt 4: A and B 9 new tokens (limit 13), C 10 (limit 14), D 3 (limit 7),
# a pool of 6 pages of 4 tokens, decode chunks of 4 steps, refill threshold 1. By hand
# (docs/sim.md "Paged KV cache"):
#  step 1  admit A, B, C: each needs pages_for(4 + 4) = 2 on top of the reserve so far (the
#          first chunks of those admitted: 0, 1, 2 pages): 2+0, 2+1, 2+2 <= 6, 5, 4 free;
#          each holds its prompt's page. D needs pages_for(6) = 2 + 3 reserved > 3 free: the
#          queue waits. The prefill samples token 1 (pos 4). Chunk: A, B, C grow to 2 pages
#          (0 free); D waits, so the chunk would end at the first finish; none does in
#          4 steps at 3 active (pos 8).
#  step 2  D: 2 + 3 reserved > 0 free. Chunk: A needs pages_for(12) = 3, none free ->
#          preempt the youngest running, C (2 pages back, to the queue head); A and B take
#          one each; both end at step 4 (pos 12 = limit - 1): 4 steps at 2 active; 6 free.
#  step 3  readmit C: prompt + 5 generated = 9 positions, chunk to 13: 4 pages <= 6 (holds
#          3, reserves 1); D: 2 + 1 <= 3. Prefill: C samples token 6 (pos 9), D token 1
#          (pos 4). Chunk: C grows to 4 pages, D to 2; D ends after 2 steps, C after 4:
#          2, 2, 1, 1 active.
HAND_REQUESTS = ([4, 4, 4, 4], [9, 9, 10, 3])
HAND = dict(steps=[4, 4, 4], active=[3.0, 2.0, 1.5], admitted=[3, 0, 2], preempted=[0, 1, 0],
            used_tokens=[24, 0, 0], queued=[True, True, False])
HAND_ENGINE = dict(max_slots=4, max_seq_len=64, prefill_buckets=(16, 64), cache_buckets=(32, 64),
                   max_prefill_batch=2, steps_per_sync=4, kv_layout="paged", page_size=4,
                   kv_budget_tokens=24)


def _check(trace, want):
    for key, value in want.items():
        np.testing.assert_array_equal(getattr(trace, key), value, err_msg=key)


def test_paged_admission_by_hand():
    trace = ChunkedEngine(*HAND_REQUESTS, rule="paged", max_slots=4, max_seq_len=64,
                          steps_per_sync=4, num_pages=6, page_size=4).run()
    _check(trace, HAND)
    assert trace.completed == 4
    summary = trace.summary()
    assert summary["mean_active"] == (12 + 8 + 6) / 12 and summary["p50_active"] == 2.0
    assert summary["mean_active_while_queued"] == 2.5
    assert summary["p50_active_while_queued"] == 2.0
    assert summary["decode_steps"] == 12 and summary["preemptions"] == 1


def test_reservation_rule_by_hand():
    # The dense rule: each reserves its limit (13) of 26 tokens: two run, the third waits
    # for a whole lifetime (the prefill's token + 8 decode steps = 2 chunks of 4), then runs
    # alone; the reservation is held whole from admission to the end.
    trace = ChunkedEngine([4, 4, 4], [9, 9, 9], rule="reserve", max_slots=4, max_seq_len=64,
                          steps_per_sync=4, budget_tokens=26).run()
    _check(trace, dict(steps=[4, 4, 4, 4], active=[2, 2, 1, 1], admitted=[2, 0, 1, 0],
                       preempted=[0] * 4, used_tokens=[26, 0, 13, 0]))


def _engine_trace(config, prompts, new_tokens):
    from flax import nnx

    from pipelinerl_jax.models import Decoder, tiny_config
    from pipelinerl_jax.rollout.jax_engine import JaxEngine
    from pipelinerl_jax.sim.paged import record_engine
    from pipelinerl_jax.records import GenerationRequest, SamplingParams
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    reqs = [GenerationRequest(f"r{i}", rng.integers(1, cfg.vocab_size, p).astype(np.int32),
                              SamplingParams(max_new_tokens=int(m), temperature=0.0, seed=i))
            for i, (p, m) in enumerate(zip(prompts, new_tokens))]
    eng = JaxEngine(Decoder(cfg, nnx.Rngs(0)), config, start=False)
    try:
        eng.stats()
        eng.submit_batch(reqs)  # no stop tokens: every request runs to max_new_tokens
        return record_engine(eng, len(reqs))
    finally:
        eng.close()


def test_engine_follows_the_hand_computed_case_and_a_random_workload():
    """The paged JaxEngine, stepped by hand, admits, preempts and decodes exactly as the model
    predicts: the hand case above, and 24 long-tailed requests in the same 6-page pool (one
    pool shape: the second case reuses the first one's compiled programs)."""
    _check(_engine_trace(HAND_ENGINE, *HAND_REQUESTS), HAND)

    rng = np.random.default_rng(7)
    new = LogNormal(median=8, tail=18, max_len=18).sample(rng, 24)  # 5 preemptions
    prompts = rng.integers(2, 7, 24)
    got = _engine_trace(HAND_ENGINE, prompts, new)
    want = ChunkedEngine(prompts, new, rule="paged", max_slots=4, max_seq_len=64,
                         steps_per_sync=4, num_pages=6, page_size=4).run()
    _check(got, {k: getattr(want, k)
                 for k in ("steps", "admitted", "preempted", "used_tokens", "queued")})
    np.testing.assert_allclose(got.active, want.active, rtol=1e-6)
    assert want.preempted.sum() > 0 and got.completed == want.completed == 24


@pytest.mark.parametrize("max_slots,pool_pages", [(4096, 100), (4096, 400), (128, 400)])
def test_closed_form_matches_the_model_in_steady_state(max_slots, pool_pages):
    """`paged_concurrency` predicts the mean active sequences while the queue is fed within
    7%: chunks run whole (4096 rows: the refill threshold of 512 never ends one early) with
    and without preemptions, and with chunks cut short by the refill threshold (128 rows,
    refill 16). The unpaged 'expected' form is off by more than 15%."""
    dist = LogNormal(median=40, tail=300, max_len=400)
    rng = np.random.default_rng(1)
    new, prompt, page, chunk = dist.sample(rng, 3000), 32, 16, 16
    trace = ChunkedEngine(np.full(new.size, prompt), new, rule="paged", max_slots=max_slots,
                          max_seq_len=prompt + 400, steps_per_sync=chunk,
                          num_pages=pool_pages, page_size=page).run()
    fed = trace.queued & (np.cumsum(trace.steps) > 400)  # past the first, fresh-cache burst
    measured = np.dot(trace.active[fed], trace.steps[fed]) / trace.steps[fed].sum()
    pool, steps = pool_pages * page, new - 1  # (the prefill samples the first token)
    predicted = paged_concurrency(pool, prompt, steps, page_size=page, steps_per_sync=chunk,
                                  refill_threshold=max(1, max_slots // 8), max_slots=max_slots)
    assert abs(predicted / measured - 1) < 0.07, (predicted, measured)
    m1, m2 = float(steps.mean()), float((steps.astype(float) ** 2).mean())
    unpaged = pool / (prompt + m2 / (2 * m1))
    assert abs(min(unpaged, max_slots) / measured - 1) > 0.15, (unpaged, measured)
    if pool_pages == 100:
        assert trace.preempted.sum() > 0


def test_closed_form_limits():
    # pages of one token, no reserve, chunk -> 1 step: the 'expected' form, prompt + E[D²]/2E[D]
    d = np.array([10, 20, 30, 200])
    got = paged_tokens_per_sequence(7, d, page_size=1, steps_per_sync=0, chunk=1.0)
    want = 7 + (d ** 2).mean() / (2 * d.mean())
    assert abs(got - want) <= 0.5 + 1e-9  # (whole steps: the mean age is (D + 1) / 2, not D / 2)
    # one sequence of 3 whole chunks of 4, prompt 4, pages of 4: holds 8, 12, 16 positions
    assert paged_tokens_per_sequence(4, [12], 4, 4) == 4 * (8 + 12 + 16) / 12 + 1.5


def test_paged_budget_in_the_simulator_config():
    c = tiny.get_config()
    c.rollout.concurrency = 100_000  # let the KV budget decide
    expected = build_setup(c)
    c.rollout.kv_budget = "paged"
    c.rollout.page_size, c.rollout.steps_per_sync = 16, 32
    paged = build_setup(c)
    steps = paged.lengths.sample(np.random.default_rng(12345), 20_000)
    want = paged_concurrency(paged.kv_capacity_tokens, 16, steps, page_size=16,
                             steps_per_sync=32, refill_threshold=100_000 // 8,
                             max_slots=100_000)
    assert paged.slots == int(want) < expected.slots
    for key in ("rollout.page_size", "rollout.steps_per_sync", "rollout.refill_threshold"):
        c2 = tiny.get_config()
        c2.rollout.kv_budget = "paged"
        node, leaf = key.split(".")
        c2[node][leaf] = -1 if leaf == "refill_threshold" else 0
        with pytest.raises(ConfigError) as e:
            build_setup(c2)
        assert e.value.key == key


def test_pages_for():
    assert [pages_for(t, 4) for t in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
