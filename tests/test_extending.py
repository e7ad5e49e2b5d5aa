"""docs/extending.md runs as printed: a new loss and a new environment are each their module
plus one registry entry, and then work through the real code paths (the jitted train step,
run-config validation, the episode runner) with nothing else changed."""
import dataclasses
import importlib
import itertools
import os
import re
import sys

import jax
import numpy as np
import pytest

from pipelinerl_jax import config as cfg_lib
from pipelinerl_jax import envs, run_config
from pipelinerl_jax.tokenizers import CharTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks(doc):
    text = open(os.path.join(ROOT, "docs", doc), encoding="utf-8").read()
    return text, re.findall(r"```python (module|registry)=(\S+)\n(.*?)```", text, re.S)


def _block(kind, name):
    _, blocks = _blocks("extending.md")
    found = [code for k, n, code in blocks if (k, n) == (kind, name)]
    assert len(found) == 1, (kind, name)
    return found[0]


def _module(name, code, tmp_path, monkeypatch):
    """Imports `code` as module `name` from a file, as a user's new module would be."""
    (tmp_path / f"{name}.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def _register(target, module, monkeypatch):
    """Adds the doc's registry entry, evaluated in the registry module's namespace (where the
    line would be written) with the new module imported there."""
    line = _block("registry", target)
    where, attr = target.split(":")
    registry_module = importlib.import_module(where)
    namespace = {**vars(registry_module), module.__name__: module}
    entry = eval("{" + line + "}", namespace)  # noqa: S307 - our own docs
    for key, value in entry.items():
        monkeypatch.setitem(getattr(registry_module, attr), key, value)
    return entry


def test_every_block_of_the_page_is_run_here():
    text, blocks = _blocks("extending.md")
    assert text.count("```python") == len(blocks) == 4
    assert {(k, n) for k, n, _ in blocks} == {
        ("module", "topr"), ("registry", "pipelinerl_jax.losses.registry:LOSSES"),
        ("module", "reverse_tool"), ("registry", "pipelinerl_jax.envs:REGISTRY")}


@pytest.fixture
def topr(tmp_path, monkeypatch):
    module = _module("topr", _block("module", "topr"), tmp_path, monkeypatch)
    _register("pipelinerl_jax.losses.registry:LOSSES", module, monkeypatch)
    return module


def test_a_new_loss_is_configured_and_validated_by_the_run_config(topr):
    cfg = run_config.base_config()
    assert "neg_cap" in cfg.loss  # the section is built from the registry
    cfg.loss.name = "topr"
    run_config.validate(cfg)
    cfg.loss.neg_cap = -1.0
    with pytest.raises(cfg_lib.ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == "loss.neg_cap" and "must be > 0" in str(e.value)
    cfg.loss.neg_cap = None
    cfg.loss.cap = 2.0  # tis's, not topr's
    with pytest.raises(cfg_lib.ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == "loss.cap"


def test_a_new_loss_trains_through_the_learner_step(topr):
    """Independent oracles through the jitted train step: on positive advantages TOPR is
    REINFORCE, on negative ones it is token TIS with cap `neg_cap`; on a mix it is neither."""
    from tests.learner.test_learner_step import _rollouts, _train

    def train(loss, rollouts, **hp):
        cfg = run_config.base_config()
        cfg.learner.optimizer.learning_rate = 1e-3
        cfg.loss.name = loss
        for k, v in hp.items():
            setattr(cfg.loss, k, v)
        params, losses, _ = _train(cfg, rollouts, steps=1)
        assert np.isfinite(losses).all()
        return params

    def diff(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    mixed = _rollouts([20, 18, 22, 19, 12, 9, 14, 11], seed=1)
    assert {np.sign(r.advantage) for r in mixed} == {-1.0, 1.0}
    pos = [dataclasses.replace(r, advantage=abs(r.advantage)) for r in mixed]
    neg = [dataclasses.replace(r, advantage=-abs(r.advantage)) for r in mixed]
    assert diff(train("topr", pos), train("reinforce", pos)) == 0.0
    topr_neg = train("topr", neg, neg_cap=1.5)
    tis_neg = train("tis", neg, cap=1.5)
    reinforce_neg = train("reinforce", neg)
    assert diff(topr_neg, tis_neg) < 1e-2 * diff(tis_neg, reinforce_neg)
    topr_mixed = train("topr", mixed, neg_cap=1.5)
    assert diff(topr_mixed, train("reinforce", mixed)) > 1e-5
    assert diff(topr_mixed, train("tis", mixed, cap=1.5)) > 1e-5


@pytest.fixture
def reverse_tool(tmp_path, monkeypatch):
    classes = re.findall(r"```python\n(.*?)```", _blocks("environments.md")[0], re.S)[0]
    code = classes + "\n\n" + _block("module", "reverse_tool")
    module = _module("reverse_tool", code, tmp_path, monkeypatch)
    _register("pipelinerl_jax.envs:REGISTRY", module, monkeypatch)
    return module


def test_a_new_environment_is_a_task_name_with_its_own_checked_keys(reverse_tool):
    cfg = run_config.base_config()
    assert cfg.env.reverse_alphabet == "abcdefgh"  # its DEFAULTS joined the env section
    cfg.task.name = "reverse_tool"
    cfg.env.reverse_alphabet = "abcdef"
    run_config.validate(cfg)
    task = envs.build_task(cfg)
    assert isinstance(task, reverse_tool.ReverseToolTask) and envs.is_env_task(cfg)
    words = [p.answer for p in itertools.islice(task.problems(0), 50)]
    assert set("".join(words)) <= set("abcdef")
    cfg.env.reverse_alphabet = "ABC"
    with pytest.raises(cfg_lib.ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == "env.reverse_alphabet"


def test_a_new_environment_runs_episodes_through_the_runner(reverse_tool):
    from tests.envs.conftest import replay_policy
    from tests.envs.scripted_engine import ScriptedEngine
    cfg = run_config.base_config()
    cfg.task.name = "reverse_tool"
    task = envs.build_task(cfg)
    tok = CharTokenizer()
    problems = list(itertools.islice(task.problems(0), 4))
    engine = ScriptedEngine(replay_policy(task, tok, problems))
    runner = envs.make_runner(cfg.env, engine, tok, task=task)
    group = envs.run_group(runner, problems[0], 3)
    assert group.ok and group.rewards.tolist() == [1.0, 1.0, 1.0]
    assert all(len(e.turns) == 2 for e in group.episodes)
