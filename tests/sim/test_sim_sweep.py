"""The split sweep: best feasible split, its speedup over sync, and infeasible splits."""
import json

from configs.sim import tiny
from pipelinerl_jax.sim.commands import run


def test_sweep_picks_the_fastest_split_within_the_staleness_limit(tmp_path, capsys):
    c = tiny.get_config("sweep")
    c.devices = 32  # CPU training is costly: most devices must train
    c.sweep.steps = 12
    c.sweep.trainers = (8, 28, 31)
    c.sweep.max_staleness = 3
    c.max_lag = None  # let staleness grow where samplers outrun the learner
    c.queue.capacity_batches = None
    out = run(c, str(tmp_path))
    rows = {r["trainers"]: r for r in out["splits"]}
    assert set(rows) == {8, 28, 31}
    for t in (8, 28):  # too many samplers: the queue grows and so does staleness
        assert rows[t]["max_staleness"] > 3 and not rows[t]["feasible"]
        assert rows[t]["learner_idle_fraction"] < 0.01
    assert rows[31]["feasible"] and rows[31]["learner_idle_fraction"] > 0.2  # too few
    ok = [r for r in out["splits"] if r["feasible"]]
    assert out["best"]["samples_per_s"] == max(r["samples_per_s"] for r in ok)
    assert out["speedup_over_sync"] == out["best"]["samples_per_s"] / out["sync"]["samples_per_s"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["best"]["trainers"] == out["best"]["trainers"]
    assert (tmp_path / "sweep.png").exists()
    # The best split in the run config's keys, ready to paste (one worker per engine).
    t, s = out["best"]["trainers"], out["best"]["samplers"]
    assert saved["recommended"] == {
        "resources.learner_devices": f"0-{t - 1}",
        "resources.sampler_devices": f"{t}-{t + s - 1}" if s > 1 else f"{t}",
        "rollout.num_workers": s // c.rollout.devices_per_engine}
    assert f"paste into a config: resources.learner_devices='0-{t - 1}' " \
           f"resources.sampler_devices=" in capsys.readouterr().out
