"""Multi-turn episodes with tool latency (sim/turns.py): closed forms, bounds, staleness."""
import math

import pytest

from configs.sim import agentic, tiny
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim.sim_config import build_setup, default_config
from pipelinerl_jax.sim.pipeline import simulate

L, TURNS, TOOL = 200, 3, 2.0


def _constant_config(turns=TURNS, tool=TOOL):
    """Constant turn lengths and tool latency, compute-bound decode, every episode in one
    engine's slots at once, so every turn of a sync step runs in lock-step."""
    c = default_config()
    c.hardware.hbm_bw_gbs = 1e12
    c.latency.sharpness = math.inf
    c.model.heads, c.model.head_dim = 1, 1
    c.lengths.kind = "empirical"
    c.lengths.observed = (L,)
    c.rollout.max_new_tokens = L
    c.rollout.prompt_len = 0
    c.rollout.concurrency = 32
    c.train.batch_size, c.train.group_size = 8, 4
    c.train.state_bytes_per_param = 0.0
    c.weight_sync_s = 0.0
    c.devices, c.split.samplers, c.split.trainers = 1, 1, 1
    c.workload.turns, c.workload.tool_latency, c.workload.env_tokens = (turns,), (tool,), 10
    c.steps = 6
    return c


def test_sync_step_is_turns_of_decode_plus_tool_latency_plus_prefill():
    c = _constant_config()
    s = build_setup(c, "sync")
    r = simulate(s)
    B, env = 32, 10
    assert s.slots >= B
    gen = (TURNS - 1) * TOOL
    for j in range(TURNS):
        ctx0 = j * (L + env)  # each turn prefills the episode so far
        gen += B * float(s.decode.prefill_time(ctx0))
        gen += L * float(s.decode.step_time(B, B * (ctx0 + (L - 1) / 2)))
    train = float(s.train.step_time(B * TURNS * L + B * env * (TURNS - 1), s.devices))
    st = r.steps
    assert (st["end_t"] - st["start_t"]) == pytest.approx([train] * c.steps, rel=1e-9)
    assert st["start_t"][0] == pytest.approx(gen, rel=1e-6)  # the first step starts at 0
    assert r.summary()["step_time_s"] == pytest.approx(gen + train, rel=1e-6)
    assert r.counters["decode_tokens"] == c.steps * B * TURNS * L


def test_single_turn_workload_is_the_single_turn_simulation():
    c = tiny.get_config("async")
    ref = simulate(build_setup(c)).summary()
    c.workload.tool_latency, c.workload.env_tokens = (3.0,), 50  # no effect with one turn
    assert build_setup(c).workload is None
    assert simulate(build_setup(c)).summary() == ref


def test_async_throughput_bounds_and_gain_grow_with_tool_latency():
    speedups = []
    for tool in (0.0, 20.0):
        c = _constant_config(tool=tool)
        c.devices, c.split.samplers, c.split.trainers = 2, 1, 1
        c.steps = 12
        sync = simulate(build_setup(c, "sync")).summary()
        s = build_setup(c, "async")
        a = simulate(s).summary()
        # Samplers: every episode needs TURNS * L decode steps of one slot, at best at the
        # per-sequence time of a full engine. Learner: one train step per batch.
        t_tok = float(s.decode.step_time(s.slots, 0)) / s.slots
        decode_bound = 1.0 / (TURNS * L * t_tok)
        train_bound = 32 / float(s.train.step_time(32 * (TURNS * L + 10 * (TURNS - 1)), 1))
        assert a["samples_per_s"] <= min(decode_bound, train_bound) * 1.001
        speedups.append(a["samples_per_s"] / sync["samples_per_s"])
    # While episodes wait on tools, async fills the slots with other episodes' turns.
    assert speedups[1] > speedups[0] * 1.5


def test_staleness_per_turn():
    c = _constant_config(tool=20.0)
    c.devices, c.split.samplers, c.split.trainers = 2, 1, 1
    c.steps, c.output.trace_steps, c.warmup_steps = 12, 12, 0
    sync = simulate(build_setup(c, "sync")).summary()
    assert sync["turn_start_lag_mean"] == [0.0] * TURNS
    c.rollout.concurrency = 64  # room for the next batch's episodes during tool waits
    lags = simulate(build_setup(c, "async")).summary()["turn_start_lag_mean"]
    assert len(lags) == TURNS
    # Later turns start later, under newer weights: their lag is smaller.
    assert all(a >= b for a, b in zip(lags, lags[1:])) and lags[0] > lags[-1]


def test_agentic_config_runs_and_bad_workload_is_refused():
    for mode in ("sync", "async"):
        c = agentic.get_config(mode)
        c.steps = 4
        r = simulate(build_setup(c)).summary()
        assert r["counters"]["trained"] == 4 * c.train.batch_size * c.train.group_size
    c = tiny.get_config()
    c.workload.turns = (0,)
    with pytest.raises(ConfigError, match="workload.turns"):
        build_setup(c)
    c.workload.turns, c.workload.tool_latency = (2,), (-1.0,)
    with pytest.raises(ConfigError, match="workload.tool_latency"):
        build_setup(c)
