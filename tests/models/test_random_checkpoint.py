"""models/random_checkpoint.py: random HF checkpoints drawn on the host with NumPy, for the
benchmarks of the Qwen2.5-0.5B shape (a whole-model jitted init took over 3 minutes to compile
on an H200). They load with `from_pretrained` into the model's names, shapes and dtypes, at the
model's own init scales, the same bytes for a seed and other bytes for another seed, and
nothing is compiled to make them."""
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from pipelinerl_jax.models import (CheckpointError, flat_params, from_pretrained,
                                   tiny_config)
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.models.hf_io import iter_safetensors
from pipelinerl_jax.models.model import INIT_STD
from pipelinerl_jax.models.random_checkpoint import (SHAPES, check_checkpoint_shape, init_kind,
                                                     random_params, write_random_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# every kind of parameter the decoder has: qkv biases (qwen2), q/k norms (qwen3), o and mlp
# biases with an untied head (llama)
CONFIGS = {
    "qwen2": tiny_config("qwen2"),
    "qwen3": tiny_config("qwen3"),
    "llama_biases": tiny_config("llama", qkv_bias=True, o_bias=True, mlp_bias=True,
                                tie_word_embeddings=False),
}


def _file_tensors(path):
    return dict(iter_safetensors(os.path.join(path, "model.safetensors")))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loads_with_from_pretrained_into_the_models_names_shapes_and_dtypes(tmp_path, name):
    cfg = CONFIGS[name]
    path = write_random_checkpoint(cfg, str(tmp_path / "ckpt"), seed=3)
    loaded = flat_params(from_pretrained(path))
    reference = flat_params(create_model(cfg, seed=0))  # the model's own random init
    assert {k: (v.shape, v.dtype) for k, v in loaded.items()} == \
        {k: (v.shape, v.dtype) for k, v in reference.items()}
    expected = random_params(cfg, seed=3)
    assert set(expected) == set(loaded)
    for k in loaded:  # the values random_params describes, laid out as from_pretrained reads
        np.testing.assert_array_equal(loaded[k], expected[k], err_msg=k)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_values_are_at_the_models_init_scales(name):
    cfg = CONFIGS[name]
    ours = random_params(cfg, seed=0)
    reference = flat_params(create_model(cfg, seed=0))
    kinds = {init_kind(k) for k in ours}
    assert {"normal", "ones"} <= kinds
    assert ("zeros" in kinds) == (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    for k, ref in reference.items():
        kind = init_kind(k)
        if kind in ("ones", "zeros"):  # norm scales and biases: exactly the model's
            np.testing.assert_array_equal(ours[k], ref, err_msg=k)
            assert np.all(ref == (1.0 if kind == "ones" else 0.0)), k
        else:  # N(0, INIT_STD^2), like the model's draw of the same tensor
            assert abs(float(np.mean(ours[k]))) < 0.1 * INIT_STD, k
            assert float(np.std(ours[k])) == pytest.approx(INIT_STD, rel=0.1), k
            assert float(np.std(ref)) == pytest.approx(INIT_STD, rel=0.1), k


def test_deterministic_in_the_seed_whatever_the_threads_and_different_across_seeds(tmp_path):
    cfg = tiny_config("qwen2")
    a = _file_tensors(write_random_checkpoint(cfg, str(tmp_path / "a"), seed=7, workers=1))
    b = _file_tensors(write_random_checkpoint(cfg, str(tmp_path / "b"), seed=7, workers=3))
    c = _file_tensors(write_random_checkpoint(cfg, str(tmp_path / "c"), seed=8))
    assert list(a) == list(b) == list(c)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    normal = [k for k in a if k.endswith("proj.weight") or k == "model.embed_tokens.weight"]
    assert normal and all(not np.array_equal(a[k], c[k]) for k in normal)
    # a tensor spanning several independently seeded blocks differs from block to block
    big = tiny_config("qwen2", vocab_size=40000, hidden_size=256)  # embed: 10.2M > 2 blocks
    emb = random_params(big, seed=0)["embed"].reshape(-1)
    blk = 1 << 22
    assert not np.array_equal(emb[:1000], emb[blk:blk + 1000])


def test_writes_the_configs_storage_dtype(tmp_path):
    cfg = tiny_config("qwen2", param_dtype=jax.numpy.bfloat16)
    path = write_random_checkpoint(cfg, str(tmp_path / "bf16"))
    assert {a.dtype for a in _file_tensors(path).values()} == {np.dtype(ml_dtypes.bfloat16)}
    model = from_pretrained(path, param_dtype="bfloat16")
    assert {v.dtype for v in flat_params(model).values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_nothing_is_compiled_to_make_one(tmp_path):
    """The point of the module: no XLA program is built (the 0.5B shape's jitted init took
    minutes to compile on a GPU). Counted by JAX's own backend-compile events."""
    compiles = []

    def listener(event, duration, **_):
        if "backend_compile" in event:
            compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        write_random_checkpoint(tiny_config("qwen3", num_layers=3), str(tmp_path / "c"), seed=1)
        # the listener does hear a compile (a constant of its own: no persistent-cache hit)
        c = float(np.random.default_rng().integers(1, 1 << 30))
        jax.jit(lambda x: x * c + 1)(np.ones(7, np.float32))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1, compiles


def test_a_replaced_checkpoint_is_whole_and_no_partial_directory_is_left(tmp_path):
    cfg = tiny_config("qwen2")
    path = str(tmp_path / "ckpt")
    write_random_checkpoint(cfg, path, seed=1)
    write_random_checkpoint(cfg, path, seed=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    np.testing.assert_array_equal(flat_params(from_pretrained(path))["embed"],
                                  random_params(cfg, seed=2)["embed"])


def test_a_checkpoint_of_another_shape_is_named_not_used(tmp_path):
    cfg = SHAPES["tiny-qwen2"]()
    path = write_random_checkpoint(cfg, str(tmp_path / "ckpt"))
    assert check_checkpoint_shape(path, cfg).num_layers == cfg.num_layers
    # the storage dtype is not the shape: from_pretrained casts
    check_checkpoint_shape(path, cfg.replace(param_dtype=jax.numpy.bfloat16))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        check_checkpoint_shape(path, cfg.replace(num_layers=3))


@pytest.mark.slow  # starts a process
def test_command_line_prints_what_it_wrote(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "pipelinerl_jax.models.random_checkpoint",
                           f"--out={tmp_path / 'c'}", "--shape=qwen2.5-0.5b", "--layers=1",
                           "--seed=5"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = SHAPES["qwen2.5-0.5b"]().replace(num_layers=1)
    assert out["layers"] == 1 and out["params"] == cfg.num_params and out["seed"] == 5
    assert out["bytes"] > 4 * cfg.num_params  # float32 tensors plus headers and config.json
    check_checkpoint_shape(out["path"], cfg)
