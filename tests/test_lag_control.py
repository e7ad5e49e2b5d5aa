"""The closed-loop staleness controller's law (`pipelinerl_jax.lag_control`): a pure function
of the metrics history, checked on scripted signal sequences; and its config validation."""
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.lag_control import (
    LAG_BUCKETS, LagController, LagLaw, Observation, decide, loss_metrics, observe, replay,
    wait_fraction)
from pipelinerl_jax.run_config import base_config, validate

LAW = LagLaw(signal="ess", target=0.9, open_at=0.95, min_lag=0, max_lag=8, window=2,
             patience=3, decrease=0.5, increase=1, min_tokens=10)


def obs(value, lag_max=8):
    return Observation(value, "5-8", lag_max)


def step_metrics(bucket="3-4", ess=0.99, kl=0.001, tokens=100, extra=None):
    """One step's flattened loss metrics with all trained tokens in `bucket`."""
    m = {}
    for b in LAG_BUCKETS:
        here = b == bucket
        m.update({f"lag_{b}/tokens": tokens if here else 0.0, f"lag_{b}/ess": ess if here else 0.0,
                  f"lag_{b}/kl_k3": kl if here else 0.0})
    m.update(extra or {})
    return m


def test_backs_off_multiplicatively_once_the_window_mean_is_unhealthy():
    assert decide(LAW, 8, [obs(0.5)]) == 8  # one step is not a window
    assert decide(LAW, 8, [obs(0.5), obs(0.5)]) == 4
    assert decide(LAW, 4, [obs(0.95), obs(0.8)]) == 2  # mean 0.875 < 0.9
    assert decide(LAW, 4, [obs(0.99), obs(0.82)]) == 4  # mean 0.905: in the band, hold
    assert decide(LAW, 1, [obs(0.1), obs(0.1)]) == 0  # floor(0.5) = 0
    assert decide(LAW, 0, [obs(0.1), obs(0.1)]) == 0  # min_lag bounds it
    # the decrease is at least one version even with a factor close to 1
    gentle = LagLaw(**{**LAW.__dict__, "decrease": 0.9})
    assert decide(gentle, 3, [obs(0.1), obs(0.1)]) == 2
    floor = LagLaw(**{**LAW.__dict__, "min_lag": 2})
    assert decide(floor, 3, [obs(0.1), obs(0.1)]) == 2


def test_opens_additively_only_after_patience_healthy_binding_steps():
    healthy = [obs(0.97, lag_max=2)] * 3
    assert decide(LAW, 2, healthy[:2]) == 2  # not patient enough yet
    assert decide(LAW, 2, healthy) == 3
    assert decide(LAW, 2, [obs(0.97, 2), obs(0.93, 2), obs(0.97, 2)]) == 2  # 0.93 < open_at
    # a limit the pipeline does not reach is not raised (nothing learned about it)
    assert decide(LAW, 2, [obs(0.99, lag_max=1)] * 3) == 2
    assert decide(LAW, 2, [obs(0.99, 1), obs(0.99, 2), obs(0.99, 1)]) == 3
    assert decide(LAW, 8, [obs(0.99)] * 5) == 8  # max_lag bounds it


def test_opens_only_while_the_limit_throttles_the_learner():
    """A learner-bound pipeline (the learner never waits) gains nothing from staler data:
    measured on the sampler-bound grid, where an ESS-only law opened to 8 while max_lag 2
    already kept the learner busy, and reached the target later than fixed max_lag 2."""
    def waited(frac):
        return Observation(0.99, "1", 2, frac)
    assert decide(LAW, 2, [waited(0.02)] * 3) == 2  # busy learner: hold
    assert decide(LAW, 2, [waited(0.02), waited(0.3), waited(0.02)]) == 3  # mean 0.113
    assert decide(LAW, 2, [waited(0.3)] * 3) == 3
    assert decide(LAW, 2, [Observation(0.5, "1", 2, 0.0)] * 2) == 1  # backing off ignores it
    assert wait_fraction({"learner/wait_time_s": 0.1, "learner/step_time_s": 0.3}) == \
        pytest.approx(0.25)
    assert wait_fraction({}) == 1.0


def test_kl_signal_reads_the_other_way_round():
    law = LagLaw(**{**LAW.__dict__, "signal": "kl_k3", "target": 0.05, "open_at": 0.01})
    assert decide(law, 4, [obs(0.1, 4), obs(0.08, 4)]) == 2
    assert decide(law, 4, [obs(0.005, 4)] * 3) == 5
    assert decide(law, 4, [obs(0.03, 4)] * 3) == 4  # in the band


def test_observe_takes_the_stalest_bucket_with_enough_tokens():
    m = step_metrics("5-8", ess=0.7)
    m.update({"lag_1/tokens": 500.0, "lag_1/ess": 0.99, "lag_9+/tokens": 3.0, "lag_9+/ess": 0.1})
    o = observe(m, lag_max=9, law=LAW)
    assert (o.bucket, o.value, o.lag_max) == ("5-8", 0.7, 9)  # 9+ has too few tokens
    assert observe(step_metrics(tokens=5), 4, LAW) is None


def test_controller_resets_its_evidence_at_every_change():
    """After a change the next decision waits for a full window under the new limit: a bad
    step trained just before the change cannot trigger a second back-off."""
    ctl = LagController(LAW)
    assert ctl.limit == 8 and ctl.announce() == {"max_lag": 8}
    bad = step_metrics("5-8", ess=0.5)
    assert ctl.update(bad, {"lag": np.array([[8]]), "loss_mask": np.array([[1]])},
                      wait_s=0.1, step_s=0.3) == {
        "lag_control/max_lag": 8, "lag_control/next_max_lag": 8, "lag_control/action": 0,
        "lag_control/signal": 0.5, "lag_control/wait_fraction": 0.25}
    d = ctl.step(bad, 8)
    assert (d.limit, d.next_limit, d.action) == (8, 4, -1)
    assert ctl.step(bad, 4).next_limit == 4  # one step under the new limit: not a window
    assert ctl.step(bad, 4).next_limit == 2
    steps_without_signal = [ctl.step(step_metrics(tokens=0), 2) for _ in range(5)]
    assert all(d.observation is None and d.next_limit == 2 for d in steps_without_signal)
    off = LagController(None)
    assert off.limit is None and off.announce() == {} and off.update(bad, {}) == {}


def test_closed_loop_settles_at_the_last_healthy_limit_and_replay_agrees():
    """A pipeline whose stale ESS degrades at lag >= 3 and always reaches the limit: the law
    halves 4 -> 2, probes 3 after `patience` healthy steps, halves 3 -> 1 after a bad
    window, climbs back 1 -> 2 -> 3 (the AIMD sawtooth, never above the last healthy limit
    + 1); `replay` of the recorded history makes the same decisions."""
    law = LagLaw(**{**LAW.__dict__, "max_lag": 4, "patience": 3})

    def record_at(limit):
        return {"step": 1, "lag/max": limit,
                **{f"loss/{k}": v for k, v in step_metrics(
                    LAG_BUCKETS[min(limit, 3)], ess=0.99 if limit <= 2 else 0.6).items()}}

    ctl, records = LagController(law), []
    for _ in range(30):
        records.append(record_at(ctl.limit))
        ctl.step(loss_metrics(records[-1]), records[-1]["lag/max"])
    limits = [d.limit for d in replay(law, records)]
    assert limits == [r["lag/max"] for r in records]
    assert limits[:3] == [4, 4, 2]  # two bad steps at 4, then halved
    assert limits[:13] == [4, 4, 2, 2, 2, 3, 3, 1, 1, 1, 2, 2, 2]
    assert set(limits[2:]) == {1, 2, 3} and limits.count(3) < len(limits) / 4


@pytest.mark.parametrize("key,value,message", [
    ("signal", "entropy", "must be one of"),
    ("target", 1.5, "(0, 1]"),
    ("open_at", 0.5, "hysteresis"),
    ("window", 0, "integer >= 1"),
    ("decrease", 1.0, "(0, 1)"),
    ("min_lag", 9, "exceeds max_lag"),
    ("initial_lag", 7, "in [lag_control.min_lag"),
    ("open_wait", 1.0, "[0, 1)"),
])
def test_config_errors_name_the_key(key, value, message):
    cfg = base_config()
    cfg.lag_control.enabled = True
    cfg.lag_control[key] = value
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == f"lag_control.{key}" and message in str(e.value)


def test_config_refuses_control_without_an_async_pipeline():
    cfg = base_config()
    cfg.lag_control.enabled = True
    validate(cfg)
    assert LagLaw.from_config(cfg) == LagLaw(max_lag=cfg.max_lag)  # the defaults agree
    cfg.mode = "sync"
    with pytest.raises(ConfigError, match="mode='async'"):
        validate(cfg)
    cfg.mode = "async"
    cfg.lag_injection.enabled = True
    with pytest.raises(ConfigError, match="lag_injection"):
        validate(cfg)
    cfg = base_config()
    cfg.lag_control.bogus = 1
    with pytest.raises(ConfigError, match="lag_control.bogus"):
        validate(cfg)
