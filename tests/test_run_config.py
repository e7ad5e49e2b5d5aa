"""Config validation happens before any process starts, with one message naming the key."""
import os
import subprocess
import sys

import pytest

from pipelinerl_jax import run_config
from pipelinerl_jax.config_checks import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _default():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, "configs",
                                                                      "default.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def test_default_and_quick_configs_validate():
    run_config.validate(_default())
    resolved = run_config.resolve(_default())
    assert resolved.transport.max_lag == resolved.max_lag
    assert resolved.transport.vocab_size > 0


@pytest.mark.parametrize("key,value,match", [
    ("loss.name", "magic", r"loss\.name"),
    ("max_lag", -1, r"^max_lag: must be an integer >= 0"),
    ("mode", "eventually", r"^mode: must be one of"),
    ("learner.batch_groups", 3, r"^learner\.batch_groups: a batch of 3 groups"),
    ("mesh.shape", (3, 1, 1), r"^learner\.batch_groups: .* mesh data\*fsdp = 3"),
    ("engine.kv_policy", "sometimes", r"engine\.kv_policy"),
    ("engine.prefix_cache_max_lag", -1, r"^engine\.prefix_cache_max_lag"),
    ("engine.tensor_parallel", -2, r"^engine\.tensor_parallel"),
    ("sampling.top_p", 1.5, r"^sampling\.top_p"),
    ("sampler.kind", "vllm", r"^sampler\.kind"),
    ("resources.learner_cores", "0-x", r"^resources\.learner_cores"),
    ("learner.optimizer.learning_rate", 0.0, r"^learner\.optimizer\.learning_rate"),
    ("transport.capacity_rollouts", 2000, r"^transport\.capacity_rollouts: 2000 cannot hold"),
])
def test_invalid_values_name_the_key(key, value, match):
    cfg = _default()
    if key == "learner.batch_groups":
        cfg.learner.micro_batches = 2  # 3 groups x 8 samples = 24 rows; 24 % (2*... )
        cfg.rollout.group_size = 1
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigError, match=match):
        run_config.validate(cfg)


def test_loss_hparam_of_another_loss_is_rejected():
    cfg = _default()
    cfg.loss.name = "ppo"
    cfg.loss.cap = 2.0  # a tis hyperparameter
    with pytest.raises(ConfigError, match=r"loss\.cap"):
        run_config.validate(cfg)


def test_one_context_length_reaches_every_role():
    cfg = _default()
    cfg.model.max_seq_len = 384
    run_config.validate(cfg)
    r = run_config.resolve(cfg)
    assert r.engine.max_seq_len == r.sglang.max_seq_len == r.transport.max_prompt_tokens == 384
    cfg.engine.max_seq_len = 200  # a shorter JaxEngine cache is allowed; the rest follow
    run_config.validate(cfg)
    r = run_config.resolve(cfg)
    assert (r.engine.max_seq_len, r.sglang.max_seq_len, r.transport.max_prompt_tokens) == \
        (200, 384, 384)


def test_an_old_command_line_setting_both_contexts_alike_still_validates():
    cfg = _default()
    cfg.model.max_seq_len = cfg.engine.max_seq_len = 320
    run_config.validate(cfg)
    assert run_config.resolve(cfg).engine.max_seq_len == 320


@pytest.mark.parametrize("key", ["engine.max_seq_len", "sglang.max_seq_len"])
def test_an_engine_context_longer_than_the_model_context_names_both_keys(key):
    cfg = _default()
    section, leaf = key.split(".")
    cfg[section][leaf] = cfg.model.max_seq_len + 1
    with pytest.raises(ConfigError, match=r"model\.max_seq_len") as e:
        run_config.validate(cfg)
    assert e.value.key == key


def test_an_hf_context_beyond_the_checkpoint_positions_names_model_max_seq_len(tmp_path):
    from tests.pipeline_testlib import make_init_checkpoint  # max_position_embeddings=32
    cfg = _default()
    cfg.model.init, cfg.model.path = "hf", make_init_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == "model.max_seq_len" and "max_position_embeddings=32" in str(e.value)


@pytest.mark.parametrize("mode,injection,admission,queue", [
    ("async", False, 2, 2),  # configs/default.py: max_lag=2
    ("sync", False, 0, 0),
    ("async", True, 0, None),  # lock-step admission; the queue cuts nothing prescribed
    ("sync", True, 0, None),
])
def test_the_lag_limits_are_derived_once(mode, injection, admission, queue):
    cfg = _default()
    cfg.mode, cfg.lag_injection.enabled = mode, injection
    run_config.validate(cfg)
    r = run_config.resolve(cfg)
    assert (r.rollout.admission_lag, r.transport.max_lag) == (admission, queue)
    run_config.validate(r)  # a resolved config is still a valid one


def test_admission_lag_is_not_a_setting():
    cfg = _default()
    cfg.rollout.admission_lag = 7
    with pytest.raises(ConfigError, match="set max_lag instead") as e:
        run_config.validate(cfg)
    assert e.value.key == "rollout.admission_lag"


def _train(tmp_path, *flags):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick",
         f"--workdir={tmp_path / 'run'}", *flags],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


@pytest.mark.slow
def test_entry_point_fails_before_starting_anything(tmp_path):
    out = _train(tmp_path, "--config.max_lag=-1")
    assert out.returncode != 0
    assert "max_lag: must be an integer >= 0" in out.stderr
    assert not (tmp_path / "run").exists()  # no workdir, no process, no checkpoint
    out = _train(tmp_path, "--config.learner.no_such_key=1")
    assert out.returncode != 0 and "no_such_key" in out.stderr
    assert not (tmp_path / "run").exists()
