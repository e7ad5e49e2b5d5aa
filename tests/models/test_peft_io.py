"""PEFT adapter directories (models/peft_io.py) without torch or peft: the export read back
exactly, adapters that do not fit and PEFT variants we do not compute refused, and the export
CLI on a finished run's checkpoint. tests/models/test_peft_export.py checks the same
directories in `peft` and `transformers` themselves."""
import json
import os

import numpy as np
import pytest

from pipelinerl_jax import sharding
from pipelinerl_jax.models import LoRASpec, WeightsMismatch, adapter_params, base_params, write_hf_dir
from pipelinerl_jax.models import peft_io
from tests.models.peft_testlib import lora_model as _model


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


@pytest.mark.slow  # runs scripts/export_lora.py in its own process
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
