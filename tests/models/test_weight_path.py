"""One weight path: every place that turns flat `{name: array}` weights
into a model goes through `models.state_from_flat`, so the same bad weights are refused the
same way, with the same message, by the JaxEngine's install, the weight sink's HF writer and
the SGLang engine's in-memory update; and nothing is installed or written for them."""
import http.server
import os
import threading

import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.models import (Decoder, WeightsMismatch, flat_params, from_pretrained,
                                   save_pretrained, state_from_flat, tiny_config, write_hf_dir)
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
from pipelinerl_jax.transport.versioned_dir import list_versions
from pipelinerl_jax.transport.weight_sink import HFDirSink, hf_checkpoint_writer
from pipelinerl_jax.transport.weights import WeightPublisher

MODEL = tiny_config(vocab_size=40, hidden_size=32, intermediate_size=64, num_heads=2,
                    num_kv_heads=1, head_dim=16)


class _NotFound(http.server.BaseHTTPRequestHandler):
    """A server that answers every call with 404 (the SGLang engine's start-up probe of
    /get_model_info then reads no version; nothing else is called before a refit)."""

    def do_GET(self):
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _bad_weights(good):
    missing = dict(good)
    missing.pop("embed")
    return {
        "missing": (missing, "missing ['embed']"),
        "unknown": ({**good, "extra/kernel": np.zeros(2, np.float32)}, "unknown ['extra/kernel']"),
        "shape": ({**good, "embed": good["embed"][:, :3]}, "'embed' has shape (40, 3)"),
        "dtype": ({**good, "final_norm/weight": good["final_norm/weight"].astype(np.int32)},
                  "'final_norm/weight' has dtype int32"),
    }


def _refusal(fn) -> str:
    with pytest.raises(WeightsMismatch) as e:
        fn()
    assert isinstance(e.value, ValueError) and isinstance(e.value, KeyError)
    return str(e.value)


def test_the_same_bad_weights_are_refused_identically_everywhere(tmp_path, stub_url):
    model = Decoder(MODEL, nnx.Rngs(0))
    init = save_pretrained(model, str(tmp_path / "init"))
    good = flat_params(model)
    like = nnx.split(nnx.eval_shape(lambda: Decoder(MODEL, nnx.Rngs(0))))[1]
    engine = JaxEngine(model, {"max_slots": 1, "max_seq_len": 32}, version=0)
    sink = HFDirSink(str(tmp_path / "sink"), WeightPublisher(), hf_checkpoint_writer(init))
    sglang = SGLangEngine([stub_url], {"health_check_interval_s": 60.0}, vocab_size=40,
                          max_seq_len=32, version=0, weights_dir=str(tmp_path / "sglang"),
                          model_config=MODEL, wait_ready=False)
    try:
        for case, (bad, says) in _bad_weights(good).items():
            expected = _refusal(lambda: state_from_flat(like, bad))
            assert says in expected, (case, expected)
            assert _refusal(lambda: engine.update_weights(bad, 1)) == expected, case
            assert _refusal(lambda: sink.publish(1, bad)) == expected, case
            assert _refusal(lambda: sglang.update_weights(bad, 1)) == expected, case
            assert _refusal(lambda: write_hf_dir(bad, MODEL, str(tmp_path / "d"))) == expected
        # Nothing was installed, written or announced for them.
        assert engine.version == 0 and sink.publisher.latest_version == -1
        assert list_versions(sink.root) == [] and list_versions(str(tmp_path / "sglang")) == []
        # The same weights, whole, go through every path.
        engine.update_weights(good, 1)
        assert engine.version == 1
        for name, value in flat_params(engine.params).items():
            np.testing.assert_array_equal(value, good[name])
        sink.publish(1, good)
        written = flat_params(from_pretrained(os.path.join(sink.root, "v00000001")))
        assert written.keys() == good.keys()
        assert all(np.array_equal(written[k], v) for k, v in good.items())
    finally:
        engine.close()
        sink.close()
        sglang.close()


def test_flat_params_reads_a_model_its_state_and_a_pure_dict_tree_alike():
    """The learner's publication flattens its pure-dict `state.params`; an engine flattens
    a model or an `nnx.State`: one function, one naming."""
    model = Decoder(MODEL, nnx.Rngs(1))
    from_model = flat_params(model)
    from_state = flat_params(nnx.state(model, nnx.Param))
    from_pure = flat_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert from_model.keys() == from_state.keys() == from_pure.keys()
    assert "embed" in from_model and "layers/0/attn/q_proj" in from_model
    for name, value in from_model.items():
        assert isinstance(from_pure[name], np.ndarray)
        np.testing.assert_array_equal(from_pure[name], value)
        np.testing.assert_array_equal(from_state[name], value)


def test_state_from_flat_never_aliases_the_callers_buffers():
    import jax
    model = Decoder(MODEL, nnx.Rngs(2))
    state = nnx.state(model, nnx.Param)
    device_flat = flat_params(model, host=False)
    rebuilt = state_from_flat(state, device_flat)
    for name, value in flat_params(rebuilt, host=False).items():
        assert isinstance(value, jax.Array)
        assert value.unsafe_buffer_pointer() != device_flat[name].unsafe_buffer_pointer(), name
    host = state_from_flat(nnx.eval_shape(lambda: nnx.state(Decoder(MODEL, nnx.Rngs(0)),
                                                           nnx.Param)), flat_params(model))
    assert all(isinstance(v, np.ndarray) for v in flat_params(host, host=False).values())
