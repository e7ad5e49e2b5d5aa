"""PEFT export (models/peft_io.py): `peft` loads our adapter directory onto the `transformers`
base our writer produced and computes our LoRA model's logits; the merged HF checkpoint,
loaded by `transformers` alone, computes them too. Tiny random models built here; nothing is
downloaded."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pipelinerl_jax import sharding  # noqa: E402
from pipelinerl_jax.models.params import path_name  # noqa: E402
from pipelinerl_jax.models import (Decoder, LoRASpec, WeightsMismatch,  # noqa: E402
                                   adapter_params, add_lora, base_params, tiny_config,
                                   write_hf_dir)
from pipelinerl_jax.models import peft_io  # noqa: E402

# H*X (32) != D (48), K*X (16) != H*X: a transposed or mis-flattened matrix cannot fit.
FAMILIES = {
    "qwen2": dict(tie_word_embeddings=True),
    "llama": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=False),
}


def _model(family, spec, seed=0):
    cfg = tiny_config(family, vocab_size=61, hidden_size=48, intermediate_size=80,
                      num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32",
                      param_dtype="float32", **FAMILIES[family])
    model = Decoder(cfg, nnx.Rngs(seed))
    add_lora(model, spec, nnx.Rngs(seed + 1))
    rng = np.random.default_rng(seed + 2)  # a trained adapter: B (and biases) off zero
    for path, var in jax.tree_util.tree_flatten_with_path(
            nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        name = path_name(path)
        if name.endswith("_lora_b") or "bias" in name:
            var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.shape), var.dtype))
    return cfg, model


def _ids():
    return np.random.default_rng(7).integers(0, 61, (2, 9)).astype(np.int64)


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_loads_our_adapter_onto_the_hf_base_with_our_logits(family, tmp_path):
    spec = LoRASpec(rank=4, alpha=8.0)
    cfg, model = _model(family, spec)
    ids = _ids()
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    base_dir = write_hf_dir(base_params(model), cfg, str(tmp_path / "base"))
    adapters = adapter_params(model)
    peft_dir = peft_io.write_peft_dir(adapters, cfg, spec, str(tmp_path / "adapter"),
                                      base_model=base_dir)

    config = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert config["target_modules"] == sorted(spec.targets)
    names = set(peft_io.peft_tensors(adapters, cfg, spec))
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight" in names
    assert len(names) == 2 * 7 * cfg.num_layers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, torch_dtype=torch.float32).eval()
    no_adapter = _torch_logits(base, ids)
    adapted = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    # every tensor of ours was placed: peft's own state dict holds each, value for value
    theirs = peft.get_peft_model_state_dict(adapted)
    assert set(theirs) == names
    got = _torch_logits(adapted, ids)
    assert np.abs(got - no_adapter).max() > 0.05  # the adapters matter at this tolerance
    np.testing.assert_allclose(got, ours, atol=2e-5, rtol=0)


def test_the_merged_export_loads_in_transformers_alone(tmp_path):
    spec = LoRASpec(rank=3, alpha=6.0, targets=("q_proj", "o_proj", "down_proj"))
    cfg, model = _model("qwen2", spec, seed=3)
    ids = _ids()
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    base_dir = write_hf_dir(base_params(model), cfg, str(tmp_path / "base"))
    merged_dir = peft_io.write_merged_dir(adapter_params(model), spec, base_dir,
                                          str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        merged_dir, torch_dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(merged, ids), ours, atol=2e-5, rtol=0)
    # and peft over the same base with a subset of targets agrees
    peft_dir = peft_io.write_peft_dir(adapter_params(model), cfg, spec,
                                      str(tmp_path / "adapter"))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, torch_dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    np.testing.assert_allclose(_torch_logits(adapted, ids), ours, atol=2e-5, rtol=0)


def test_read_peft_dir_inverts_the_export_exactly(tmp_path):
    spec = LoRASpec(rank=4, alpha=8.0, targets=("k_proj", "o_proj", "up_proj"))
    cfg, model = _model("llama", spec, seed=5)
    adapters = adapter_params(model)
    path = peft_io.write_peft_dir(adapters, cfg, spec, str(tmp_path / "a"))
    back, spec_back = peft_io.read_peft_dir(path, cfg)
    assert spec_back == spec
    assert set(back) == set(adapters)
    for name, arr in adapters.items():
        np.testing.assert_array_equal(back[name], arr)


def test_export_refuses_adapters_that_do_not_fit(tmp_path):
    spec = LoRASpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    cfg, model = _model("qwen2", spec)
    adapters = adapter_params(model)
    with pytest.raises(WeightsMismatch, match=r"expected \(48, 2\)"):
        peft_io.write_peft_dir(adapters, cfg, LoRASpec(2, 4.0, spec.targets), str(tmp_path))
    with pytest.raises(WeightsMismatch, match="missing"):
        peft_io.write_peft_dir({k: v for k, v in adapters.items() if "layers/1/" not in k},
                               cfg, spec, str(tmp_path))
    bad = dict(adapters)
    bad["layers/0/attn/q_proj_lora_a"] = bad["layers/0/attn/q_proj_lora_a"][:-1]
    with pytest.raises(WeightsMismatch, match="q_proj_lora_a"):
        peft_io.write_peft_dir(bad, cfg, spec, str(tmp_path))


def test_a_peft_variant_we_do_not_compute_is_refused(tmp_path):
    spec = LoRASpec(rank=2, alpha=4.0, targets=("q_proj",))
    cfg, model = _model("qwen2", spec)
    path = peft_io.write_peft_dir(adapter_params(model), cfg, spec, str(tmp_path / "a"))
    config_path = os.path.join(path, "adapter_config.json")
    raw = json.load(open(config_path))
    raw["use_rslora"] = True
    json.dump(raw, open(config_path, "w"))
    with pytest.raises(Exception, match="use_rslora"):
        peft_io.read_peft_dir(path, cfg)


def _lora_run(tmp_path, spec):
    """A finished LoRA run's directory: config.json, the base, one checkpoint of adapters."""
    from pipelinerl_jax.learner import train_step as ts
    from pipelinerl_jax.learner.checkpoint import Checkpointer
    from pipelinerl_jax.models.lora import base_identity
    from pipelinerl_jax.run_config import base_config
    cfg, model = _model("qwen2", spec, seed=9)
    base_dir = write_hf_dir(base_params(model), cfg, str(tmp_path / "base"))
    run = base_config()
    run.lora.enabled, run.lora.rank, run.lora.alpha = True, spec.rank, spec.alpha
    run.lora.targets = ",".join(spec.targets)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(run.to_json())
    optimizer, _ = ts.make_optimizer(run.learner.optimizer)
    state = ts.init_state(model, optimizer, sharding.make_mesh((1, 1, 1)))
    ckpt = Checkpointer(str(workdir / "checkpoints"), async_save=False)
    ckpt.save(5, ts.checkpointed(state), {"version": 5, "lora_base": base_identity(base_dir)})
    ckpt.close()
    return cfg, model, base_dir, workdir


def test_export_cli_writes_a_runs_checkpointed_adapters(tmp_path):
    import subprocess
    import sys
    from pipelinerl_jax.models import flat_params, from_pretrained, merged_params
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "o_proj", "gate_proj"))
    cfg, model, base_dir, workdir = _lora_run(tmp_path, spec)
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "export_lora.py"),
         f"--workdir={workdir}", f"--peft={tmp_path / 'peft'}", f"--merged={tmp_path / 'm'}"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["step"], summary["version"], summary["rank"]) == (5, 5, 2)
    back, spec_back = peft_io.read_peft_dir(str(tmp_path / "peft"), cfg)
    assert spec_back == spec
    ours = adapter_params(model)
    assert set(back) == set(ours)
    for name in ours:
        np.testing.assert_array_equal(back[name], ours[name])
    assert json.load(open(tmp_path / "peft" / "adapter_config.json"))[
        "base_model_name_or_path"] == os.path.abspath(base_dir)
    merged = flat_params(from_pretrained(str(tmp_path / "m")))
    want = merged_params(model, spec)
    assert set(merged) == set(want)
    for name in want:
        np.testing.assert_allclose(merged[name], want[name], atol=1e-6, rtol=0)

    # the base the checkpoint names has changed on disk: nothing is written
    from pipelinerl_jax.models import hf_io
    tensors = dict(hf_io.iter_safetensors(os.path.join(base_dir, "model.safetensors")))
    tensors = {k: np.array(v) for k, v in tensors.items()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    hf_io.write_safetensors(os.path.join(base_dir, "model.safetensors"), tensors)
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "export_lora.py"),
         f"--workdir={workdir}", f"--peft={tmp_path / 'peft2'}"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root), timeout=300)
    assert out.returncode != 0 and "is not the base" in out.stderr
    assert not os.path.exists(tmp_path / "peft2")
