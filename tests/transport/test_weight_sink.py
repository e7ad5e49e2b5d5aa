"""Weight sinks: what the learner's `publish` delivers, over the stream or as HF directories."""
import os

import numpy as np
import pytest

from pipelinerl_jax.models import (LoRASpec, flat_params, from_pretrained, save_pretrained,
                                   tiny_config)
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.models.lora import base_identity
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.versioned_dir import list_versions, version_dir
from pipelinerl_jax.transport.weight_sink import (HFDirSink, StreamSink, hf_checkpoint_writer,
                                                  make_weight_sink, read_weight_version,
                                                  weights_dir)
from pipelinerl_jax.transport.weight_version import DESCRIPTION_FILE, WeightVersion
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber

FAST = RetryPolicy(initial_s=0.01, max_s=0.1)
SPEC = LoRASpec(2, 4.0, ("q_proj", "down_proj"))
MODEL = tiny_config(vocab_size=40, hidden_size=32, intermediate_size=64, num_heads=2,
                    num_kv_heads=1, head_dim=16)


class Received:
    """Records (version, arrays or path, policy version) and the messages' kinds."""

    def __init__(self):
        self.calls, self.kinds = [], []

    def __call__(self, message):
        params = message.path  # a directory publication hands over its path
        if params is None:
            params = {k: np.array(v) for k, v in message.tensors.items()}
        self.calls.append((message.version, params, message.policy))
        self.kinds.append((message.kind, message.base_sha256, message.lora))


def _files(directory):
    """The weights' files (the message's description beside them aside)."""
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if name != DESCRIPTION_FILE}


def test_stream_sink_ships_the_arrays_and_the_policy_version(tmp_path):
    got = Received()
    sink = make_weight_sink("stream", base_config(), str(tmp_path), publisher=WeightPublisher())
    assert isinstance(sink, StreamSink)
    sub = WeightSubscriber(sink.publisher.address, got, retry=FAST)
    try:
        sink.publish(0, {"w": np.zeros(3, np.float32)})
        assert sub.wait_for_version(0, 10)
        sink.publish(4, {"w": np.full(3, 2.0, np.float32)}, policy_version=2)
        assert sub.wait_for_version(4, 10)
    finally:
        sub.close()
        sink.close()
    assert [(v, pv) for v, _, pv in got.calls] == [(0, 0), (4, 2)]
    np.testing.assert_array_equal(got.calls[1][1]["w"], np.full(3, 2.0, np.float32))
    assert not os.path.exists(weights_dir(base_config(), str(tmp_path)))  # nothing on disk


def test_hf_dir_sink_writes_what_save_pretrained_writes_and_announces_it(tmp_path):
    init = str(tmp_path / "init")
    save_pretrained(create_model(MODEL, seed=0), init)
    cfg = base_config()
    cfg.sampler.keep_weight_versions = 2
    got = Received()
    sink = make_weight_sink("hf_dir", cfg, str(tmp_path), publisher=WeightPublisher(),
                            init_checkpoint=init)
    assert isinstance(sink, HFDirSink) and sink.root == str(tmp_path / "weights")
    sub = WeightSubscriber(sink.publisher.address, got, retry=FAST)
    models = [create_model(MODEL, seed=s) for s in (1, 2, 3)]
    try:
        for version, model in enumerate(models):
            sink.publish(version, flat_params(model), policy_version=max(0, version - 1))
            assert sub.wait_for_version(version, 10)
    finally:
        sub.close()
        sink.close()
    # What was published travels in the message: each version's directory (absolute), no
    # tensors on the stream, the policy version in the header.
    assert [(v, p, pv) for v, p, pv in got.calls] == [
        (v, os.path.abspath(version_dir(sink.root, v)), pv) for v, pv in ((0, 0), (1, 0), (2, 1))]
    assert list_versions(sink.root) == [1, 2]  # keep_weight_versions
    assert set(got.kinds) == {("full", "", None)}
    assert read_weight_version(version_dir(sink.root, 2), WeightVersion("lora", "x", SPEC)) \
        == WeightVersion("full").carrying(2, path=os.path.abspath(version_dir(sink.root, 2)),
                                          policy_version=1)  # what the directory says
    # The directory is byte for byte what save_pretrained of the learner's model writes.
    ref = str(tmp_path / "ref")
    save_pretrained(models[2], ref)
    assert _files(version_dir(sink.root, 2)) == _files(ref)
    loaded = flat_params(from_pretrained(version_dir(sink.root, 2)))
    for name, value in flat_params(models[2]).items():
        np.testing.assert_array_equal(loaded[name], value)


def test_hf_dir_sink_refuses_weights_of_another_model(tmp_path):
    init = str(tmp_path / "init")
    save_pretrained(create_model(MODEL, seed=0), init)
    sink = HFDirSink(str(tmp_path / "w"), WeightPublisher(), hf_checkpoint_writer(init))
    try:
        params = flat_params(create_model(MODEL, seed=1))
        params["extra/kernel"] = np.zeros(2, np.float32)
        with pytest.raises(KeyError, match="extra/kernel"):
            sink.publish(0, params)
        assert list_versions(sink.root) == []  # nothing half-written appears
    finally:
        sink.close()


def test_make_weight_sink_checks_its_arguments(tmp_path):
    cfg = base_config()
    with pytest.raises(ValueError, match="unknown 'sglang'"):
        make_weight_sink("sglang", cfg, str(tmp_path))
    with pytest.raises(ValueError, match="init_checkpoint"):
        make_weight_sink("hf_dir", cfg, str(tmp_path))
    cfg.sampler.weights_dir = str(tmp_path / "elsewhere")
    assert weights_dir(cfg, str(tmp_path)) == str(tmp_path / "elsewhere")


def test_hf_dir_sink_saves_through_a_given_callable(tmp_path):
    saved = []

    def save_model(params, directory):
        saved.append(sorted(params))
        with open(os.path.join(directory, "marker"), "w") as f:
            f.write("x")

    sink = make_weight_sink("hf_dir", base_config(), str(tmp_path),
                            publisher=WeightPublisher(), save_model=save_model)
    try:
        sink.publish(3, {"a": np.zeros(1, np.float32)})
    finally:
        sink.close()
    assert saved == [["a"]] and os.path.isfile(os.path.join(version_dir(sink.root, 3), "marker"))


def test_hf_dir_sink_of_a_lora_run_writes_peft_adapter_directories(tmp_path):
    from pipelinerl_jax.models import adapter_params
    from pipelinerl_jax.models.peft_io import read_peft_dir
    init = str(tmp_path / "init")
    save_pretrained(create_model(MODEL, seed=0), init)
    cfg = base_config()
    cfg.lora.enabled, cfg.lora.rank, cfg.lora.alpha = True, 2, 4.0
    cfg.lora.targets = "q_proj,down_proj"
    spec = SPEC
    sink = make_weight_sink("hf_dir", cfg, str(tmp_path), publisher=WeightPublisher(),
                            init_checkpoint=init)
    adapters = adapter_params(create_model(MODEL, seed=1, lora=spec))
    got = Received()
    sub = WeightSubscriber(sink.publisher.address, got, retry=FAST)
    try:
        sink.publish(0, adapters)
        assert sub.wait_for_version(0, 10)
    finally:
        sub.close()
        sink.close()
    # the message says what it carries: adapters of this base, of this rank/alpha/targets
    assert got.kinds == [("lora", base_identity(init)["sha256"], spec)]
    back, spec_back = read_peft_dir(version_dir(sink.root, 0), MODEL)
    assert spec_back == spec and set(back) == set(adapters)
    for name, value in adapters.items():
        np.testing.assert_array_equal(back[name], value)
    assert sorted(os.listdir(version_dir(sink.root, 0))) == [
        "adapter_config.json", "adapter_model.safetensors", DESCRIPTION_FILE]
