"""Parity with `transformers` reference implementations on tiny random checkpoints built here."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.optional_deps import optional  # noqa: E402

torch = optional("torch")
transformers = optional("transformers")

from pipelinerl_jax.models import (CheckpointError, Decoder, from_pretrained,  # noqa: E402
                                   init_cache, save_pretrained)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_theta=500000.0, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16})),
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=16, tie_word_embeddings=False)),
}


def _hf_model(family, seed=0):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                  **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # move norms/biases off their trivial init so they are tested
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    # The sharded variant exercises model.safetensors.index.json.
    model.save_pretrained(path, max_shard_size="20KB" if request.param == "qwen3" else "5GB")
    ids = torch.randint(0, 97, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    return request.param, path, ids.numpy().astype(np.int32), ref, model


def test_logits_match_transformers(hf_checkpoint):
    family, path, ids, ref, _ = hf_checkpoint
    if family == "qwen3":
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ours = from_pretrained(path)
    out = np.asarray(ours(jnp.asarray(ids)))
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_save_pretrained_roundtrip_through_transformers(hf_checkpoint, tmp_path):
    _, path, ids, ref, _ = hf_checkpoint
    ours = from_pretrained(path)
    save_pretrained(ours, str(tmp_path), max_shard_bytes=30_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        out = reloaded(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_kv_cache_decode_matches_full_forward(hf_checkpoint):
    _, path, ids, _, _ = hf_checkpoint
    model = from_pretrained(path)
    fwd = nnx.jit(lambda m, x, **kw: m(x, **kw))
    full = np.asarray(fwd(model, jnp.asarray(ids)))
    b, t = ids.shape
    prompt = 5
    cache = init_cache(model.cfg, b, 32)
    pos = jnp.broadcast_to(jnp.arange(prompt), (b, prompt))
    logits, cache = fwd(model, jnp.asarray(ids[:, :prompt]), positions=pos, cache=cache)
    np.testing.assert_allclose(np.asarray(logits), full[:, :prompt], atol=1e-4)
    for i in range(prompt, t):
        step_pos = jnp.full((b, 1), i, jnp.int32)
        logits, cache = fwd(model, jnp.asarray(ids[:, i:i + 1]), positions=step_pos, cache=cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, i], atol=1e-4)


def test_kv_cache_rows_at_different_positions():
    """Continuous batching decodes rows at different positions in one call."""
    from pipelinerl_jax.models import tiny_config
    model = Decoder(tiny_config(), nnx.Rngs(3))
    fwd = nnx.jit(lambda m, ids, **kw: m(ids, **kw))
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, 64, 9), rng.integers(3, 64, 4)
    full_a = np.asarray(fwd(model, jnp.asarray(a[None])))[0]
    full_b = np.asarray(fwd(model, jnp.asarray(b[None])))[0]
    cache = init_cache(model.cfg, 2, 16)
    # Right-padded prefill of both rows (a: 8 tokens, b: 3 tokens).
    ids = np.zeros((2, 8), np.int32)
    ids[0], ids[1, :3] = a[:8], b[:3]
    _, cache = fwd(model, jnp.asarray(ids), positions=jnp.broadcast_to(jnp.arange(8), (2, 8)),
                   cache=cache)
    step = jnp.asarray([[a[8]], [b[3]]], jnp.int32)
    logits, _ = fwd(model, step, positions=jnp.asarray([[8], [3]]), cache=cache)
    np.testing.assert_allclose(np.asarray(logits[0, 0]), full_a[8], atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[1, 0]), full_b[3], atol=1e-5)


def test_bfloat16_load(hf_checkpoint):
    _, path, ids, ref, _ = hf_checkpoint
    model = from_pretrained(path, dtype="bfloat16")
    assert model.embed[...].dtype == jnp.bfloat16
    out = np.asarray(model(jnp.asarray(ids)))
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 0.25  # bf16 rounding, not a different model


# ----------------------------------------------------------------------------- bad inputs

@pytest.fixture
def llama_dir(tmp_path):
    _hf_model("llama").save_pretrained(str(tmp_path))
    return tmp_path


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="missing config.json"):
        from_pretrained(str(tmp_path))


def test_missing_weights_file(llama_dir):
    os.remove(llama_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        from_pretrained(str(llama_dir))


def test_truncated_weights_file(llama_dir):
    f = llama_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or inconsistent"):
        from_pretrained(str(llama_dir))


def test_corrupt_header(llama_dir):
    f = llama_dir / "model.safetensors"
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        from_pretrained(str(llama_dir))


def test_unsupported_model_type(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        from_pretrained(str(llama_dir))


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
])
def test_unsupported_feature_names_field(llama_dir, field, value, match):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[field] = value
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(str(llama_dir))


def test_mismatched_tensor_shape(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96  # checkpoint has 80
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight' has shape"):
        from_pretrained(str(llama_dir))
