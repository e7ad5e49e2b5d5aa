"""One table of engine backends (`rollout/factory.py`): the run config builds and checks every
row's section, the launcher's `make_engine` dispatches on it, and a new backend is its own
functions plus one row (the worked example of docs/engine.md, "Adding a backend")."""
import importlib.util
import os

import ml_collections
import pytest

from pipelinerl_jax import config as cfg_lib
from pipelinerl_jax import run_config
from pipelinerl_jax.rollout import factory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_config():
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, "configs",
                                                                      "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def test_the_rows():
    assert factory.SAMPLER_KINDS == ("jax", "sglang")
    jax, sglang = factory.backend("jax"), factory.backend("sglang")
    assert (jax.section, jax.weight_sink) == ("engine", "stream")
    assert (sglang.section, sglang.weight_sink) == ("sglang", "hf_dir")
    assert all(b.weight_sink in factory.WEIGHT_SINKS for b in factory.BACKENDS.values())
    cfg = run_config.base_config()
    assert cfg.engine.to_dict() == jax.config().to_dict()
    assert cfg.sglang.to_dict() == sglang.config().to_dict()
    with pytest.raises(ValueError, match=r"unknown 'vllm'; valid: \('jax', 'sglang'\)"):
        factory.backend("vllm")


def test_a_new_backend_is_one_row(monkeypatch):
    seen = []

    def echo_config():
        return ml_collections.ConfigDict(dict(delay_s=0.0))

    def validate_echo(cfg, selected):
        seen.append(selected)
        cfg_lib.number(cfg, "echo.delay_s", lo=0.0)

    def make_echo_engine(cfg, init_checkpoint, index, workdir):
        return ("echo engine", index, cfg.echo.delay_s)

    monkeypatch.setitem(factory.BACKENDS, "echo", factory.Backend(
        "echo", echo_config, validate_echo, make_echo_engine, "stream"))
    cfg = default_config()  # built from run_config.base_config(): has an `echo` section
    assert cfg.echo.delay_s == 0.0
    run_config.validate(cfg)
    assert seen == [False]  # checked while another kind samples
    cfg.sampler.kind = "echo"
    run_config.validate(cfg)
    assert seen == [False, True]
    assert factory.make_engine(cfg, "ckpt", 1, "/tmp") == ("echo engine", 1, 0.0)
    cfg.echo.delay_s = -1.0
    with pytest.raises(cfg_lib.ConfigError, match=r"^echo\.delay_s: must be >= 0.0"):
        run_config.validate(cfg)


def test_sglang_servers_are_required_only_when_sglang_samples():
    cfg = default_config()
    assert cfg.sampler.kind == "jax" and not cfg.sglang.urls
    run_config.validate(cfg)  # no servers needed
    cfg.sampler.kind = "sglang"
    with pytest.raises(cfg_lib.ConfigError, match=r"^sglang\.urls: 0 server\(s\)"):
        run_config.validate(cfg)
