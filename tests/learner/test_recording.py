"""Recorded batches (`learner.record_batches`): what is written, and how it is read back."""
import json
import os

import ml_collections
import numpy as np
import pytest

from pipelinerl_jax import run_config
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.learner import batching, recording
from pipelinerl_jax.learner.replay import config_differences
from pipelinerl_jax.records import Rollout


def _rollout(gid, reward, n=3, version=0):
    return Rollout(prompt_ids=np.array([1, 2], np.int32),
                   completion_ids=np.arange(3, 3 + n, dtype=np.int32),
                   logp_behaviour=np.full(n, -0.5, np.float32),
                   version=np.full(n, version, np.int32), kv_version=np.full(n, version, np.int32),
                   reward=reward, advantage=reward - 0.5, group_id=gid, group_size=2)


def _packed(rollouts, version):
    return batching.pack(rollouts, version, num_seqs=4, chunks=1, pack_len=16,
                         completion_len=5)


def test_recorded_arrays_and_index_read_back(tmp_path):
    rec = recording.BatchRecorder(str(tmp_path), "/ckpt/model", {"loss": {"name": "tis"}})
    rollouts = [_rollout("w0-a-0", 1.0), _rollout("w0-a-0", 0.0), _rollout("w0-a-1", 1.0, 4)]
    for step in (1, 2):
        p = _packed(rollouts, version=step)
        rec.record(step, step - 1, f"b{step}", rollouts, p.arrays, {"reward/mean": 2 / 3})
    # A restarted learner retrains step 2 on another batch: the last record wins.
    again = _packed(rollouts[:2], version=3)
    rec.record(2, 1, "b2-again", rollouts[:2], again.arrays, {"reward/mean": 0.5})

    directory = recording.recording_dir(str(tmp_path))
    assert directory == os.path.join(str(tmp_path), "recorded")
    meta = recording.read_meta(directory)
    assert meta["init_checkpoint"] == "/ckpt/model" and meta["config"]["loss"]["name"] == "tis"
    index = recording.read_index(directory)
    assert [(e["step"], e["version"], e["batch_id"]) for e in index] == [
        (1, 0, "b1"), (2, 1, "b2-again")]
    assert index[0]["group_ids"] == ["w0-a-0", "w0-a-0", "w0-a-1"]
    assert index[0]["rewards"] == [1.0, 0.0, 1.0]
    first = recording.load_arrays(directory, index[0])
    want = _packed(rollouts, version=1).arrays
    assert set(first) == set(want)
    for k in want:
        np.testing.assert_array_equal(first[k], want[k])
        assert first[k].dtype == want[k].dtype
    np.testing.assert_array_equal(recording.load_arrays(directory, index[1])["lag"],
                                  again.arrays["lag"])
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_a_missing_step_is_an_error(tmp_path):
    rec = recording.BatchRecorder(str(tmp_path), "/ckpt")
    p = _packed([_rollout("g-0", 1.0)], 1)
    rec.record(1, 0, "b1", [], p.arrays, {})
    rec.record(3, 2, "b3", [], p.arrays, {})
    with pytest.raises(ValueError, match=r"lacks steps \[2\]"):
        recording.read_index(recording.recording_dir(str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="record_batches"):
        recording.read_meta(str(tmp_path / "elsewhere"))


def test_recorder_only_when_configured(tmp_path):
    cfg = run_config.base_config()
    assert cfg.learner.record_batches is False
    assert recording.recorder(cfg, str(tmp_path), "/ckpt") is None
    cfg.learner.record_batches = True
    assert isinstance(recording.recorder(cfg, str(tmp_path), "/ckpt"),
                      recording.BatchRecorder)
    with open(tmp_path / "recorded" / "meta.json") as f:
        assert json.load(f)["config"]["learner"]["record_batches"] is True


def test_record_batches_must_be_a_bool():
    cfg = run_config.base_config()
    learner = cfg.learner.to_dict()
    learner["record_batches"] = "yes"  # as a hand-written config.json could say
    cfg.learner = ml_collections.ConfigDict(learner)
    with pytest.raises(ConfigError, match=r"^learner\.record_batches"):
        run_config.validate(cfg)


def test_config_differences_name_learner_relevant_keys_only():
    rec = {"loss": {"name": "tis", "cap": 2.0}, "mesh": {"shape": [1, 1, 1]},
           "learner": {"minibatches": 1, "eval_every": 5,
                       "optimizer": {"learning_rate": 1e-4}}}
    now = {"loss": {"name": "ppo", "cap": 2.0}, "mesh": {"shape": (1, 1, 1)},
           "learner": {"minibatches": 1, "eval_every": 2,
                       "optimizer": {"learning_rate": 1e-4}}}
    assert config_differences(rec, now) == {"loss.name": ["tis", "ppo"]}
