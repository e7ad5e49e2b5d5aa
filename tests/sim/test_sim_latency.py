"""The latency model against the roofline formulas it claims to implement."""
import dataclasses
import math

import numpy as np
import pytest

from pipelinerl_jax.sim.hardware import ACCELERATORS, MODELS
from pipelinerl_jax.sim.latency import DecodeLatency, TrainTime, kv_capacity_tokens

H100, QWEN = ACCELERATORS["h100"], MODELS["qwen2.5-7b"]


def _roofline_by_hand(acc, m, batch, ctx):
    weights = m.params * m.weight_bytes
    kv_per_token = 2 * m.layers * m.kv_heads * m.head_dim * m.kv_bytes
    t_mem = (weights + kv_per_token * ctx) / (acc.hbm_bw * acc.mbu)
    flops = 2 * m.params * batch + 4 * m.layers * m.heads * m.head_dim * ctx
    t_cmp = flops / (acc.peak_flops * acc.mfu)
    return t_mem, t_cmp


@pytest.mark.parametrize("batch,ctx_per_seq", [(1, 100), (8, 2000), (64, 1000), (512, 4000), (4096, 300)])
def test_one_device_hard_roofline_is_the_formula(batch, ctx_per_seq):
    lat = DecodeLatency.roofline(H100, QWEN, tp=1, sharpness=math.inf)
    ctx = batch * ctx_per_seq
    t_mem, t_cmp = _roofline_by_hand(H100, QWEN, batch, ctx)
    assert lat.step_time(batch, ctx) == pytest.approx(max(t_mem, t_cmp), rel=1e-12)
    assert lat.memory_time(ctx) == pytest.approx(t_mem, rel=1e-12)
    assert lat.compute_time(batch, ctx) == pytest.approx(t_cmp, rel=1e-12)


def test_smooth_transition_matches_the_regimes_away_from_the_knee():
    lat = DecodeLatency.roofline(H100, QWEN)  # default sharpness 4
    t_mem, _ = _roofline_by_hand(H100, QWEN, 1, 500)
    assert lat.step_time(1, 500) == pytest.approx(t_mem, rel=1e-6)
    _, t_cmp = _roofline_by_hand(H100, QWEN, 20000, 20000 * 10)
    assert lat.step_time(20000, 20000 * 10) == pytest.approx(t_cmp, rel=1e-3)
    # At the knee the smooth curve sits 2^(1/4) above both.
    b = lat.knee_batch(0)
    assert lat.step_time(b, 0) == pytest.approx(2 ** 0.25 * lat.memory_time(0), rel=1e-9)


def test_doubling_bandwidth_halves_memory_bound_latency():
    fast = dataclasses.replace(H100, hbm_bw=2 * H100.hbm_bw)
    for sharp in (math.inf, 4.0):
        slow_t = DecodeLatency.roofline(H100, QWEN, sharpness=sharp).step_time(1, 1000)
        fast_t = DecodeLatency.roofline(fast, QWEN, sharpness=sharp).step_time(1, 1000)
        assert fast_t == pytest.approx(slow_t / 2, rel=1e-6)


def test_tensor_parallel_engine_adds_bandwidth_and_flops():
    one = DecodeLatency.roofline(H100, QWEN, tp=1, sharpness=math.inf)
    two = DecodeLatency.roofline(H100, QWEN, tp=2, sharpness=math.inf)
    for b in (1, 4096):
        assert two.step_time(b, b * 100) == pytest.approx(one.step_time(b, b * 100) / 2, rel=1e-12)


def test_latency_is_flat_then_rising_in_batch():
    lat = DecodeLatency.roofline(H100, QWEN)
    b = np.array([1, 2, 4, 8, 16, 1024, 2048, 4096])
    t = lat.step_time(b, b * 0)
    assert t[4] / t[0] < 1.01  # memory-bound: batch is free
    assert t[-1] / t[-2] > 1.9  # compute-bound: linear in batch
    assert np.all(np.diff(t) >= 0)


def test_kv_capacity_and_train_time_formulas():
    cap = kv_capacity_tokens(H100, QWEN, tp=1)
    kv = 2 * 28 * 4 * 128 * 2
    assert cap == pytest.approx((80e9 * 0.9 - 7.62e9 * 2) / kv)
    assert kv_capacity_tokens(H100, QWEN, tp=2) > 2 * cap  # weights counted once
    tt = TrainTime.roofline(H100, QWEN)
    assert tt.step_time(1e6, 8) == pytest.approx(6 * 7.62e9 * 1e6 / (8 * 989e12 * 0.4))
