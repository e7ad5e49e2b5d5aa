"""PEFT export (models/peft_io.py) against `peft` and `transformers` (torch): `peft` loads our
adapter directory onto the `transformers` base our writer produced and computes our LoRA
model's logits; the merged HF checkpoint, loaded by `transformers` alone, computes them too.
Tiny random models built here; nothing is downloaded. What needs neither torch nor peft
(reading back, refusals, the export CLI) is tests/models/test_peft_io.py."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from tests.optional_deps import optional

torch = optional("torch")
transformers = optional("transformers")
peft = optional("peft")

from pipelinerl_jax.models import (LoRASpec, adapter_params, base_params,  # noqa: E402
                                   write_hf_dir)
from pipelinerl_jax.models import peft_io  # noqa: E402
from tests.models.peft_testlib import FAMILIES, lora_model as _model  # noqa: E402


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
