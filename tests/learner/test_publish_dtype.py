"""`learner.publish_dtype`: a float32 learner feeding a bf16 engine publishes bf16 (half the
HBM snapshot, half the bytes to host and on the wire) and the engine serves bit-identical
weights either way; the config resolves and validates, naming the key."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.learner import loop, multihost
from pipelinerl_jax.models import flat_params, save_pretrained
from pipelinerl_jax.models.factory import build_model
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.run_config import base_config, publish_dtype
from pipelinerl_jax.tokenizer import get_tokenizer
from tests.learner.test_eval_off_step import _Queue, _Sink

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_auto_publishes_the_embedded_engines_dtype_when_narrower():
    cfg = base_config()
    assert cfg.learner.publish_dtype == "auto" and publish_dtype(cfg) is None  # f32 engine
    cfg.engine.dtype = "bfloat16"
    assert publish_dtype(cfg) == BF16
    cfg.model.param_dtype = "bfloat16"  # trained in bf16: nothing to cast
    assert publish_dtype(cfg) is None
    cfg.model.param_dtype = "float32"
    cfg.sampler.kind = "sglang"  # the server loads what it is sent in its own dtype
    assert publish_dtype(cfg) is None
    cfg.sampler.kind = "jax"
    cfg.lag_injection.enabled = True  # the injector's history stays in the learner's dtype
    assert publish_dtype(cfg) is None


def test_explicit_values_and_bad_ones_name_the_key():
    cfg = base_config()
    cfg.learner.publish_dtype = "bfloat16"
    assert publish_dtype(cfg) == BF16
    cfg.learner.publish_dtype = "float32"  # the learner's own: no cast
    assert publish_dtype(cfg) is None
    cfg.learner.publish_dtype = "int8"
    with pytest.raises(ConfigError, match="learner.publish_dtype"):
        publish_dtype(cfg)
    cfg.learner.publish_dtype = "bfloat16"
    cfg.lag_injection.enabled = True
    with pytest.raises(ConfigError, match="learner.publish_dtype.*lag_injection"):
        publish_dtype(cfg)


@pytest.mark.parametrize("on_device", [True, False])
def test_snapshot_casts_floating_leaves_only(on_device):
    params = {"w": jnp.linspace(-3.0, 3.0, 1000, dtype=jnp.float32).reshape(10, 100) / 7,
              "n": jnp.arange(5, dtype=jnp.int32)}
    snap = jax.device_get(multihost.snapshot_params(params, on_device=on_device, dtype=BF16))
    assert np.asarray(snap["w"]).dtype == BF16 and np.asarray(snap["n"]).dtype == np.int32
    want = np.asarray(params["w"]).astype(BF16)  # numpy's (ml_dtypes') round to nearest even
    assert np.array_equal(np.asarray(snap["w"]).view(np.uint16), want.view(np.uint16))
    assert np.array_equal(snap["n"], np.arange(5))
    plain = jax.device_get(multihost.snapshot_params(params, on_device=on_device))
    assert np.asarray(plain["w"]).dtype == np.float32  # None: as trained


def _learner_run(tmp_path, name, publish):
    cfg = base_config()
    cfg.learner.total_steps, cfg.learner.batch_groups = 2, 1
    cfg.learner.checkpoint_every, cfg.learner.eval_every = 100, 0
    cfg.rollout.group_size = 2
    cfg.sampling.max_new_tokens, cfg.model.max_seq_len = 8, 16
    cfg.learner.optimizer.learning_rate = 1e-2  # versions visibly differ
    cfg.engine.dtype = "bfloat16"
    cfg.learner.publish_dtype = publish
    tok = get_tokenizer(cfg.tokenizer)
    init = str(tmp_path / "init")
    save_pretrained(build_model(cfg.model, tok.vocab_size), init)
    sink = _Sink([])
    loop.run_learner(cfg, str(tmp_path / name), init, batches=_Queue(tok.vocab_size),
                     weight_sink=sink, evals=None)
    return {v: flat for v, (_, flat) in sink.params.items()}


def test_the_learner_publishes_bf16_and_an_engine_serves_the_same_weights(tmp_path):
    """Two runs of the learner loop on the same batches: 'auto' (bf16 engine) publishes
    bf16, 'float32' publishes as trained. Training is the same; each published bf16 tensor
    is its float32 twin rounded; and a bf16 engine handed either installs the same bits."""
    auto = _learner_run(tmp_path, "auto", "auto")
    full = _learner_run(tmp_path, "full", "float32")
    assert sorted(auto) == sorted(full) == [0, 1, 2]
    for v in auto:
        assert {x.dtype for x in auto[v].values()} == {BF16}
        assert {x.dtype for x in full[v].values()} == {np.dtype(np.float32)}
        for name, x in full[v].items():
            assert np.array_equal(auto[v][name].view(np.uint16),
                                  x.astype(BF16).view(np.uint16)), (v, name)
    assert any(not np.array_equal(auto[0][k], auto[2][k]) for k in auto[0])  # it trained

    tok = get_tokenizer(base_config().tokenizer)
    cfg = base_config().model
    cfg.max_seq_len = 16
    model = build_model(cfg, tok.vocab_size)
    shape = {"max_slots": 2, "max_seq_len": 16, "dtype": "bfloat16"}
    served = []
    for flat in (auto[2], full[2]):
        engine = JaxEngine(model, shape)
        try:
            engine.update_weights(flat, 1)
            served.append({k: np.asarray(v) for k, v in flat_params(engine.params).items()})
        finally:
            engine.close()
    assert served[0].keys() == served[1].keys()
    for k in served[0]:
        assert served[0][k].dtype == BF16
        assert np.array_equal(served[0][k].view(np.uint16), served[1][k].view(np.uint16)), k
