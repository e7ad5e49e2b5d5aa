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

from pipelinerl_jax.models import (Decoder, LeafSlots, WeightsMismatch, flat_params,
                                   from_pretrained, save_pretrained, state_from_flat, tiny_config, write_hf_dir)
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


def test_leaf_slots_swap_only_the_named_arrays_with_state_from_flats_checks():
    """A LoRA engine's per-version swap: the named arrays are placed fresh (never aliasing
    the caller's), every other array is the live state's own object, and the result equals
    `state_from_flat` of the whole; bad weights are refused as everywhere else."""
    import jax
    model = Decoder(MODEL, nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    live = flat_params(state, host=False)
    names = ["layers/0/attn/q_proj", "final_norm/weight"]
    slots = LeafSlots(nnx.eval_shape(lambda: nnx.state(Decoder(MODEL, nnx.Rngs(0)),
                                                       nnx.Param)), names)
    rng = np.random.default_rng(0)
    new = {n: rng.standard_normal(live[n].shape).astype(np.float32) for n in names}
    out = flat_params(slots.replace(state, new), host=False)
    assert out.keys() == live.keys()
    for name, value in out.items():
        if name in names:
            np.testing.assert_array_equal(np.asarray(value), new[name])
        else:
            assert value is live[name], name  # the live array itself, not a copy
    whole = flat_params(state_from_flat(state, {**live, **new}))
    for name, value in flat_params(slots.replace(state, new)).items():
        np.testing.assert_array_equal(value, whole[name])
    device_new = {n: jax.numpy.asarray(a) for n, a in new.items()}
    on_device = LeafSlots(state, names)  # a live state's slots: placed where its arrays are
    for name, value in flat_params(on_device.replace(state, device_new), host=False).items():
        if name in names:
            assert value.unsafe_buffer_pointer() != device_new[name].unsafe_buffer_pointer()
    assert "'layers/0/attn/q_proj' has shape (3," in _refusal(lambda: slots.replace(
        state, {**new, "layers/0/attn/q_proj": new["layers/0/attn/q_proj"][:3]}))
    assert "has dtype int32" in _refusal(lambda: slots.replace(
        state, {**new, "final_norm/weight": new["final_norm/weight"].astype(np.int32)}))
    assert "missing ['final_norm/weight']" in _refusal(lambda: slots.replace(
        state, {"layers/0/attn/q_proj": new["layers/0/attn/q_proj"]}))
    assert "not parameters" in _refusal(lambda: LeafSlots(state, ["nope"]))


def test_leaf_slots_move_host_adapters_as_one_buffer_split_onto_each_slots_layout():
    """A LoRA engine's slots are NamedShardings on its mesh: host arrays of one dtype travel
    as one buffer and a jitted split lays each out as its slot says (here tensor-parallel
    over 2 devices); the values are exact. Device arrays (the in-process learner's) take the
    per-array path."""
    import jax
    from pipelinerl_jax.sharding import make_mesh, state_shardings
    from pipelinerl_jax.models.lora import LoRASpec, add_lora
    model = Decoder(tiny_config(vocab_size=40, hidden_size=32, intermediate_size=64,
                                num_heads=2, num_kv_heads=2, head_dim=16), nnx.Rngs(4))
    add_lora(model, LoRASpec(4, 8.0), nnx.Rngs(5))
    state = nnx.state(model, nnx.Param)
    shardings = state_shardings(state, make_mesh((1, 1, 2)))
    live = state_from_flat(state, flat_params(state, host=False), shardings)
    names = sorted(n for n in flat_params(state) if n.endswith(("_lora_a", "_lora_b")))
    slots = LeafSlots(state, names, shardings)
    rng = np.random.default_rng(1)
    new = {n: rng.standard_normal(flat_params(state)[n].shape).astype(np.float32)
           for n in names}
    want = {n: s.get_value() for n, s in zip(
        flat_params(state), jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(
            x, nnx.Variable)))}
    for rounds in range(2):  # the split is made once and reused
        out = flat_params(slots.replace(live, new), host=False)
        for name in names:
            np.testing.assert_array_equal(np.asarray(out[name]), new[name])
            assert out[name].sharding == want[name], name
    assert slots._split is not None  # the packed path ran
    assert any(len(want[n].device_set) == 2 and not want[n].is_fully_replicated
               for n in names)  # some adapter really is split across the devices
