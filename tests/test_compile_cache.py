"""compile_cache.enable: the directory and the compile-time threshold it hands JAX."""
import jax
import pytest

from pipelinerl_jax import compile_cache


@pytest.fixture
def restore_jax_cache_config():
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in before.items():
        jax.config.update(k, v)


def test_threshold_comes_from_the_environment(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("PIPELINERL_JAX_CACHE_MIN_SECS", "0.25")
    assert compile_cache.enable(str(tmp_path)) == str(tmp_path)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25
    monkeypatch.delenv("PIPELINERL_JAX_CACHE_MIN_SECS")
    compile_cache.enable(str(tmp_path))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5


@pytest.mark.parametrize("bad", ["soon", "-1", "nan"])
def test_a_bad_threshold_names_the_variable(bad, tmp_path, monkeypatch,
                                            restore_jax_cache_config):
    monkeypatch.setenv("PIPELINERL_JAX_CACHE_MIN_SECS", bad)
    with pytest.raises(ValueError, match="PIPELINERL_JAX_CACHE_MIN_SECS"):
        compile_cache.enable(str(tmp_path))


def test_off_leaves_jax_alone(monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("PIPELINERL_JAX_CACHE", "off")
    assert compile_cache.enable() is None
