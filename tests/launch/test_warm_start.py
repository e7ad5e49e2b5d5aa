"""The one warm start of the launcher and the ablation runner: a given checkpoint, a finished
one reused, the pretrained model as is, or SFT in a child process (slow: a real one)."""
import os
import sys

import pytest

from pipeline_testlib import ROOT, make_init_checkpoint
from pipelinerl_jax import run_config
from pipelinerl_jax.config import ConfigError
from pipelinerl_jax.launch.warm_start import warm_start


def _config(**warm):
    sys.path.insert(0, ROOT)
    from configs import default
    c = default.get_config("quick")
    c.task.median_length, c.task.p99_length, c.task.max_length = 3, 6, 8
    c.sampling.max_new_tokens = 9
    c.model.max_seq_len = 32
    c.learner.eval_size = 0
    c.learner.eval_every = 0
    c.warm_start.update(warm)
    return c


def _no_child(msg):
    raise AssertionError(f"no SFT expected, got: {msg}")


def test_a_given_checkpoint_is_used_and_checked(tmp_path, monkeypatch):
    ckpt = make_init_checkpoint(str(tmp_path / "init"))
    monkeypatch.chdir(tmp_path)
    assert warm_start(_config(checkpoint="init"), str(tmp_path / "run"), log=_no_child) == ckpt
    with pytest.raises(ConfigError) as e:
        warm_start(_config(checkpoint=str(tmp_path)), str(tmp_path / "run"), log=_no_child)
    assert e.value.key == "warm_start.checkpoint"


def test_a_finished_warm_start_is_reused_and_a_pretrained_model_kept(tmp_path):
    run = tmp_path / "run"
    model = make_init_checkpoint(str(run / "warm_start" / "model"))
    assert warm_start(_config(steps=30), str(run), log=_no_child) == model
    c = _config(steps=0)
    c.model.init, c.model.path = "hf", "/some/pretrained"
    assert warm_start(c, str(tmp_path / "other"), log=_no_child) == "/some/pretrained"
    assert not os.path.exists(tmp_path / "other" / "warm_start")


@pytest.mark.slow
def test_sft_runs_in_a_child_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device, as in a real run
    c = run_config.resolve(_config(steps=2, batch_size=4, log_every=1))
    said = []
    model = warm_start(c, str(tmp_path), progress=True, timeout_s=300, log=said.append)
    ws = tmp_path / "warm_start"
    assert model == str(ws / "model") and os.path.isfile(ws / "model" / "config.json")
    assert os.path.isfile(ws / "config.json") and os.path.isfile(ws / "logs" / "sft.log")
    assert said[0].startswith("warm start: 2 supervised steps") and "done" in said[-1]
    assert warm_start(c, str(tmp_path), log=_no_child) == model


def test_sft_is_bit_reproducible(tmp_path):
    """Same config and seed -> the same parameters, bit for bit (data order and XLA:CPU are
    deterministic); another seed -> other parameters."""
    from pipelinerl_jax.learner.sft import run_sft
    files = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        c = _config(steps=6, batch_size=8, log_every=1)
        c.seed = seed
        out = tmp_path / name
        run_sft(run_config.resolve(c), str(out), progress=False)
        files[name] = (out / "model" / "model.safetensors").read_bytes()
    assert files["a"] == files["b"]
    assert files["a"] != files["c"]
