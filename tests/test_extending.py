"""docs/extending.md runs as printed: a new loss, environment and backend are each their module
plus one registry entry, and then work through the real code paths (the jitted train step,
run-config validation, the episode runner, a rollout worker over a real queue) with nothing
else changed."""
import dataclasses
import importlib
import itertools
import os
import re
import sys

import jax
import numpy as np
import pytest

from pipelinerl_jax import config_checks as cfg_lib
from pipelinerl_jax import envs, run_config
from pipelinerl_jax.tokenizer import CharTokenizer, get_tokenizer

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
    assert text.count("```python") == len(blocks) == 6
    assert {(k, n) for k, n, _ in blocks} == {
        ("module", "topr"), ("registry", "pipelinerl_jax.losses.registry:LOSSES"),
        ("module", "reverse_tool"), ("registry", "pipelinerl_jax.envs:REGISTRY"),
        ("module", "echo_backend"), ("registry", "pipelinerl_jax.rollout.factory:BACKENDS")}


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
    from tests.learner.step_testlib import _rollouts, _train

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


@pytest.fixture
def echo_backend(tmp_path, monkeypatch):
    module = _module("echo_backend", _block("module", "echo_backend"), tmp_path, monkeypatch)
    _register("pipelinerl_jax.rollout.factory:BACKENDS", module, monkeypatch)
    return module


def test_a_new_backend_is_a_sampler_kind_the_worker_drives(echo_backend, tmp_path):
    """The row gives the run config an `echo` section, checked before start; the factory
    builds the engine; the base class's blocking `generate` serves it; and an unchanged
    RolloutWorker fills a learner batch on a real queue from it."""
    from pipelinerl_jax.rollout import factory
    from pipelinerl_jax.rollout.worker import RolloutWorker
    from pipelinerl_jax.tasks import get_task
    from pipelinerl_jax.transport import RolloutQueueClient, RolloutQueueServer
    from pipelinerl_jax.records import GenerationRequest, SamplingParams
    cfg = run_config.base_config()
    cfg.sampler.kind = "echo"
    cfg.echo.repeat = 0
    with pytest.raises(cfg_lib.ConfigError) as e:
        run_config.validate(cfg)
    assert e.value.key == "echo.repeat"
    cfg.echo.repeat = 2
    cfg.rollout.group_size, cfg.learner.batch_groups = 2, 2
    run_config.validate(cfg)
    cfg = run_config.resolve(cfg)
    engine = factory.make_engine(cfg, "unused", 0, str(tmp_path))
    assert isinstance(engine, echo_backend.EchoEngine) and engine.version == -1
    engine.update_weights({}, 0)
    outs = engine.generate([GenerationRequest(f"r{i}", np.array([4, 5, 6 + i], np.int32),
                                              SamplingParams(max_new_tokens=5, n=2))
                            for i in range(2)])
    assert [(c.request_id, c.sample_index) for c in outs] == [("r0", 0), ("r0", 1),
                                                              ("r1", 0), ("r1", 1)]
    assert outs[2].token_ids.tolist() == [4, 5, 7, 4, 5]
    assert (outs[0].version == 0).all() and outs[0].finish_reason == "length"

    server = RolloutQueueServer(max_lag=cfg.max_lag).start()
    learner, producer = RolloutQueueClient(server.address), RolloutQueueClient(server.address)
    tok = get_tokenizer(cfg.tokenizer)
    worker = RolloutWorker(cfg, engine, get_task(cfg.task), tok, producer)
    try:
        learner.set_version(0)
        batch = None
        for _ in range(100):
            worker.run(max_seconds=0.05)
            batch = learner.get_batch(2, timeout_s=0.05, learner_version=0)
            if batch is not None:
                break
        assert batch is not None and len(batch.rollouts) == 4
        for r in batch.rollouts:  # the echo of its prompt, sampled at version 0
            np.testing.assert_array_equal(
                r.completion_ids, np.tile(r.prompt_ids, 2)[:len(r.completion_ids)])
            assert (r.version == 0).all()
    finally:
        worker.close()
        for c in (learner, producer):
            c.close()
        server.stop()
        engine.close()
