"""Invalid descriptions fail before simulating, with the offending key first."""
import pytest

from configs.sim import talk, tiny
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim.sim_config import build_setup


def _expect(key, edit, cfg=None):
    c = cfg or tiny.get_config()
    edit(c)
    with pytest.raises(ConfigError) as e:
        build_setup(c)
    assert e.value.key == key
    assert str(e.value).startswith(key + ":")
    return str(e.value)


def _set(path, value):
    def edit(c):
        node = c
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return edit


def test_split_larger_than_devices():
    msg = _expect("split.samplers", _set("split.samplers", 3))  # 3 + 2 > 4
    assert "exceeds devices = 4" in msg


def test_kv_cache_below_one_sequence():
    c = talk.get_config()
    msg = _expect("rollout.max_new_tokens", _set("hardware.hbm_gb", 20.0), c)  # 8B weights: 16 GB
    assert "KV cache" in msg


@pytest.mark.parametrize("key,value", [
    ("weight_sync_s", -1.0), ("hardware.hbm_bw_gbs", -5.0), ("hardware.peak_tflops", 0.0),
    ("hardware.mfu", 1.5), ("lengths.median", -3.0), ("train.batch_size", 0),
    ("rollout.concurrency", -2), ("steps", 0), ("max_lag", -1), ("queue.capacity_batches", 0),
])
def test_negative_or_out_of_range_numbers(key, value):
    _expect(key, _set(key, value))


@pytest.mark.parametrize("key,value", [
    ("hardware.preset", "a100-but-typo"), ("model.preset", "gpt-9"), ("mode", "pipelined"),
    ("lengths.kind", "zipf"), ("rollout.kv_budget", "some"),
])
def test_unknown_names(key, value):
    msg = _expect(key, _set(key, value))
    assert "must be one of" in msg


def test_unknown_key_is_rejected():
    c = tiny.get_config()
    c.unlock()
    c.train.learning_rate = 1e-3
    with pytest.raises(ConfigError) as e:
        build_setup(c)
    assert e.value.key == "train.learning_rate"


def test_learner_too_small_for_training_state():
    c = talk.get_config()
    _expect("split.trainers", _set("split.trainers", 1), c)  # 8B x 16 B/param > 80 GB


def test_empirical_lengths_need_data():
    c = tiny.get_config()
    c.lengths.kind = "empirical"
    _expect("lengths.observed", lambda c: None, c)
    _expect("lengths.path", _set("lengths.path", "/nonexistent/run"), c)
