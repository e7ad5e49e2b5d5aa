"""Held-out evaluation is one fixed set in every cell of a grid: the ablation configs evaluate
on >= 256 prompts, a task's eval problems do not depend on the run's seed, and a grid whose
cells would evaluate on different sets is refused, naming the key."""
import importlib
import sys

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import grid
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.tasks import get_task

sys.path.insert(0, ROOT)
CONFIGS = ["staleness", "sync_vs_async", "kv_policy"]


@pytest.mark.parametrize("arg", ["", "quick"])
@pytest.mark.parametrize("name", CONFIGS)
def test_ablation_configs_evaluate_every_cell_on_one_set_of_at_least_256(name, arg):
    c = importlib.import_module(f"configs.ablate.{name}").get_config(arg)
    runs = grid.expand(c)
    sets = {(r.config.task.to_json(), r.config.learner.eval_size) for r in runs}
    assert len(sets) == 1 and c.experiment.learner.eval_size >= 256
    assert all(r.config.learner.eval_every > 0 for r in runs)


@pytest.mark.parametrize("name", ["reverse", "countdown"])
def test_eval_problems_do_not_depend_on_the_run_seed(name):
    from configs import default
    cfgs = []
    for seed in (0, 7):
        cfg = default.get_config()
        cfg.task.name, cfg.seed = name, seed
        cfgs.append(cfg)
    a, b = (get_task(cfg.task).eval_problems(256) for cfg in cfgs)
    assert [(p.id, p.prompt, p.answer) for p in a] == [(p.id, p.prompt, p.answer) for p in b]
    train = {p.prompt for _, p in zip(range(2000), get_task(cfgs[0].task).problems(0))}
    assert not train & {p.prompt for p in a}  # held out from training, too


@pytest.mark.parametrize("axis", [
    grid.sweep("learner.eval_size", (128, 256)),
    grid.variants(("small", {"learner": {"eval_size": 64}}), ("same", {})),
])
def test_a_grid_whose_cells_evaluate_on_different_sets_is_refused(axis):
    from configs.ablate import staleness
    c = staleness.get_config("quick")
    c.axes.evalset = axis
    with pytest.raises(ConfigError, match=r"^learner\.eval_size: run .* same held-out set") as e:
        grid.expand(c)
    assert e.value.key == "learner.eval_size"
