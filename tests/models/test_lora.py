"""LoRA adapters (models/lora.py): the `lora` config section is refused before start with the
key named; fresh adapters change nothing; the forward with adapters equals the base with
them merged (float32 merge); adapters shard like their base; bad adapters are refused."""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax import run_config, sharding
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.models import (Decoder, LoRASpec, WeightsMismatch, adapter_params,
                                   add_lora, base_params, decoder_from_flat, flat_params,
                                   merge_lora, merged_params, tiny_config, token_logprobs)
from pipelinerl_jax.models.lora import TARGETS, lora_config, validate_lora_config
from pipelinerl_jax.models.params import path_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = tiny_config(vocab_size=48, hidden_size=32, intermediate_size=64, num_heads=4,
                    num_kv_heads=2, head_dim=8, dtype="float32", param_dtype="float32")
ALL = LoRASpec(rank=4, alpha=8.0)


def _default():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "cfg", os.path.join(ROOT, "configs", "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _randomise_b(model, seed=1):
    """Non-zero B (a trained adapter): without it the adapter's term is exactly zero."""
    rng = np.random.default_rng(seed)
    for path, var in jax.tree_util.tree_flatten_with_path(
            nnx.state(model, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        if path_name(path).endswith("_lora_b"):
            var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), var.dtype))
    return model


def _ids(seed=0, b=3, t=11):
    return jnp.asarray(np.random.default_rng(seed).integers(0, MODEL.vocab_size, (b, t)),
                       jnp.int32)


def test_the_lora_section_is_off_by_default_and_validates():
    cfg = _default()
    assert cfg.lora.enabled is False
    run_config.validate(cfg)
    cfg.lora.enabled = True
    run_config.validate(cfg)


@pytest.mark.parametrize("key,value,match", [
    ("rank", 0, r"^lora\.rank: must be an integer >= 1"),
    ("rank", -3, r"^lora\.rank: must be an integer >= 1, got -3"),
    ("alpha", 0.0, r"^lora\.alpha: must be a positive number"),
    ("alpha", float("nan"), r"^lora\.alpha"),
    ("targets", "q_proj,qkv", r"^lora\.targets: unknown projection\(s\) \['qkv'\]; valid: "
                              r"\['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj'"),
    ("targets", " , ", r"^lora\.targets: names no projection"),
    ("targets", "q_proj,q_proj", r"^lora\.targets: names a projection twice"),
])
def test_bad_lora_settings_name_the_key(key, value, match):
    cfg = _default()
    cfg.lora.enabled = True
    with cfg.lora.unlocked():
        cfg.lora[key] = value
    with pytest.raises(ConfigError, match=match):
        run_config.validate(cfg)


def test_an_unknown_lora_key_is_refused_and_sglang_accepted():
    cfg = _default()
    with cfg.lora.unlocked():
        cfg.lora.dropout = 0.1
    with pytest.raises(ConfigError, match=r"lora"):
        run_config.validate(cfg)
    cfg = _default()  # SGLang servers load adapters (sglang-jax ones are refused at start-up)
    cfg.lora.enabled = True
    cfg.sampler.kind = "sglang"
    cfg.sglang.urls, cfg.sglang.eval_urls = ("http://127.0.0.1:1",), ("http://127.0.0.1:2",)
    run_config.validate(cfg)
    assert set(lora_config().targets.split(",")) == set(TARGETS)
    loose = ml_collections.ConfigDict(dict(lora_config(), enabled="yes"))  # a config file's
    with pytest.raises(ConfigError, match=r"^lora\.enabled: must be True or False"):
        validate_lora_config(loose)


def test_fresh_adapters_leave_the_forward_exactly_the_base():
    base = Decoder(MODEL, nnx.Rngs(0))
    ids = _ids()
    want = np.asarray(base(ids))
    adapted = add_lora(Decoder(MODEL, nnx.Rngs(0)), ALL, nnx.Rngs(7))
    assert adapted.layers[0].attn.q_proj_lora_b[...].shape == (4, 4, 8)
    assert np.array_equal(np.asarray(adapted(ids)), want)  # B = 0: bit for bit
    for k, v in flat_params(base).items():  # the base is untouched by attaching adapters
        assert np.array_equal(v, base_params(adapted)[k]), k
    names = sorted(adapter_params(adapted))
    assert len(names) == 2 * len(TARGETS) * MODEL.num_layers
    assert "layers/0/attn/q_proj_lora_a" in names and "layers/1/mlp/down_proj_lora_b" in names


@pytest.mark.parametrize("targets", [tuple(TARGETS), ("q_proj", "o_proj", "down_proj")])
def test_merged_adapters_give_the_unmerged_log_probs(targets):
    spec = LoRASpec(rank=4, alpha=16.0, targets=targets)
    model = _randomise_b(add_lora(Decoder(MODEL, nnx.Rngs(0)), spec, nnx.Rngs(3)))
    ids = _ids(seed=2)
    unmerged = token_logprobs(model(ids)[:, :-1], ids[:, 1:])
    merged_model = decoder_from_flat(merged_params(model, spec), MODEL)
    merged = token_logprobs(merged_model(ids)[:, :-1], ids[:, 1:])
    base = token_logprobs(decoder_from_flat(base_params(model), MODEL)(ids)[:, :-1], ids[:, 1:])
    diff = float(jnp.max(jnp.abs(merged - unmerged)))
    moved = float(jnp.max(jnp.abs(base - unmerged)))
    print(f"\nlora targets={len(targets)}: merged vs unmerged max |dlogp| = {diff:.2e} "
          f"(adapters move log-probs by up to {moved:.2e})")
    assert diff < 1e-5
    assert moved > 1e-3  # the adapters do something, so the agreement means something


def test_merge_is_float32_then_cast_to_the_base_dtype():
    w = np.asarray(np.random.default_rng(0).standard_normal((6, 5)), jnp.bfloat16)
    a = np.random.default_rng(1).standard_normal((6, 2)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((2, 5)).astype(np.float32)
    out = merge_lora({"x/up_proj": w, "x/other": w},
                     {"x/up_proj_lora_a": a, "x/up_proj_lora_b": b}, 0.5)
    want = (w.astype(np.float32) + 0.5 * a @ b).astype(jnp.bfloat16)
    assert out["x/up_proj"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out["x/up_proj"]), want)
    assert out["x/other"] is w


def test_adapters_that_do_not_fit_the_base_are_refused():
    model = _randomise_b(add_lora(Decoder(MODEL, nnx.Rngs(0)), ALL, nnx.Rngs(3)))
    base, ad = base_params(model), adapter_params(model)
    qa, qb = "layers/0/attn/q_proj_lora_a", "layers/0/attn/q_proj_lora_b"
    cases = {
        "no base": ({**ad, "layers/9/attn/q_proj_lora_a": ad[qa],
                     "layers/9/attn/q_proj_lora_b": ad[qb]}, "which the base does not hold"),
        "rank": ({**ad, qa: ad[qa][:, :2]}, "do not fit 'layers/0/attn/q_proj'"),
        "shape": ({**ad, qb: ad[qb][:, :2]}, "do not fit 'layers/0/attn/q_proj'"),
        "no B": ({k: v for k, v in ad.items() if k != qb}, "comes without"),
        "no A": ({k: v for k, v in ad.items() if k != qa}, "comes without its A"),
        "not adapter": ({**ad, "embed": base["embed"]}, "'embed' is not an adapter weight"),
    }
    for what, (bad, message) in cases.items():
        with pytest.raises(WeightsMismatch, match=message):
            merge_lora(base, bad, ALL.scale)


def test_adapters_shard_like_their_base(eight_devices):
    mesh = sharding.make_mesh((1, 4, 2))
    specs = sharding.param_specs(nnx.eval_shape(
        lambda: add_lora(Decoder(MODEL, nnx.Rngs(0)), ALL, nnx.Rngs(1))))
    P = jax.sharding.PartitionSpec
    assert specs["layers/0/attn/q_proj"] == P("fsdp", "tensor")
    assert specs["layers/0/attn/q_proj_lora_a"] == P("fsdp")  # [D, r]: r unsharded
    assert specs["layers/0/attn/q_proj_lora_b"] == P(None, "tensor")  # [r, H, X]
    assert specs["layers/0/attn/o_proj_lora_a"] == P("tensor")  # [H, X, r]
    assert specs["layers/0/attn/o_proj_lora_b"] == P(None, "fsdp")  # [r, D]
    assert specs["layers/0/mlp/down_proj_lora_a"] == P("tensor")
    assert specs["layers/0/mlp/down_proj_lora_b"] == P(None, "fsdp")
    abstract = nnx.split(nnx.eval_shape(
        lambda: add_lora(Decoder(MODEL, nnx.Rngs(0)), ALL, nnx.Rngs(1))))[1]
    sharding.state_shardings(abstract, mesh)  # every adapter dim divides (rank unsplit)


def test_base_identity_names_the_exact_checkpoint(tmp_path):
    from pipelinerl_jax.models import save_pretrained
    from pipelinerl_jax.models.lora import base_identity
    model = Decoder(MODEL, nnx.Rngs(0))
    save_pretrained(model, str(tmp_path / "a"))
    save_pretrained(model, str(tmp_path / "b"))
    a, b = base_identity(str(tmp_path / "a")), base_identity(str(tmp_path / "b"))
    assert a["sha256"] == b["sha256"] and a["path"] != b["path"]
    model.embed.set_value(model.embed[...].at[0, 0].add(1e-3))
    save_pretrained(model, str(tmp_path / "b"))
    assert base_identity(str(tmp_path / "b"))["sha256"] != a["sha256"]
