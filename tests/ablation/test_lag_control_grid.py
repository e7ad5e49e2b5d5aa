"""The auto-vs-fixed max_lag grid (`configs/ablate/lag_control.py`) expands into valid runs on
one held-out set, from a base experiment chosen by name."""
import sys

import pytest

from pipeline_testlib import ROOT
from pipelinerl_jax.ablation import grid

sys.path.insert(0, ROOT)


@pytest.mark.parametrize("arg,runs", [("", 12), ("quick", 2), ("quick,default", 2)])
def test_grid_expands_to_valid_runs(arg, runs):
    from configs.ablate import lag_control
    specs = grid.expand(lag_control.get_config(arg))  # validates every run's config
    assert len(specs) == runs
    assert len({(r.config.task.to_json(), r.config.learner.eval_size) for r in specs}) == 1
    for r in specs:
        auto = r.labels["schedule"] == "auto"
        assert r.config.mode == "async" and r.config.lag_control.enabled == auto
        assert r.config.max_lag == (lag_control.AUTO_MAX_LAG if auto
                                    else int(r.labels["schedule"][len("fixed"):]))


def test_base_experiment_is_chosen_by_module_name():
    from configs.ablate import lag_control
    with pytest.raises(ModuleNotFoundError):
        lag_control.get_config("no_such_base")
    with pytest.raises(ValueError, match="at most one base"):
        lag_control.get_config("default,default")
