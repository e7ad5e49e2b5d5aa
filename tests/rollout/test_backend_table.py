"""One table of engine backends (`rollout/factory.py`): the run config builds and checks every
row's section, the launcher's `make_engine` dispatches on it, and a new backend is its own
functions plus one row (the worked example: docs/extending.md, run by tests/test_extending.py)."""
import importlib.util
import os

import ml_collections
import pytest

from pipelinerl_jax import config_checks as cfg_lib
from pipelinerl_jax import run_config
from pipelinerl_jax.rollout import factory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_config():
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, "configs",
                                                                      "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("kind", sorted(factory.BACKENDS))
def test_every_row_builds_a_section_the_run_config_checks_and_resolves(kind):
    row = factory.backend(kind)
    assert row.weight_sink in factory.WEIGHT_SINKS  # a sink transport/weight_sink provides
    section = run_config.base_config()[row.section].to_dict()
    defaults = row.config().to_dict()
    defaults.pop(run_config.CONTEXT_KEY, None)
    assert section.pop(run_config.CONTEXT_KEY) is None  # left to resolve
    assert section == defaults
    cfg = default_config()
    cfg.sampler.kind = kind
    resolved = run_config.resolve(cfg)
    assert resolved[row.section][run_config.CONTEXT_KEY] == cfg.model.max_seq_len
    cfg[row.section][run_config.CONTEXT_KEY] = cfg.model.max_seq_len * 2
    with pytest.raises(cfg_lib.ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == f"{row.section}.{run_config.CONTEXT_KEY}"


def test_an_unknown_kind_is_refused_naming_every_row():
    with pytest.raises(ValueError) as e:
        factory.backend("no-such-backend")
    assert all(repr(kind) in str(e.value) for kind in factory.BACKENDS)
    cfg = default_config()
    cfg.sampler.kind = "no-such-backend"
    with pytest.raises(cfg_lib.ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == "sampler.kind"


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
