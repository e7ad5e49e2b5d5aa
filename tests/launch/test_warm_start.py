"""The one warm start of the launcher and the ablation runner: a given checkpoint, a finished
one reused, the pretrained model as is, or SFT in a child process (slow: a real one)."""
import os
import sys

import pytest

from pipeline_testlib import ROOT, make_init_checkpoint
from pipelinerl_jax import run_config
from pipelinerl_jax.config_checks import ConfigError
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
    from pipelinerl_jax.launch.demonstrations import sft_on_demonstrations
    files = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        c = _config(steps=6, batch_size=8, log_every=1)
        c.seed = seed
        out = tmp_path / name
        sft_on_demonstrations(run_config.resolve(c), str(out), progress=False)
        files[name] = (out / "model" / "model.safetensors").read_bytes()
    assert files["a"] == files["b"]
    assert files["a"] != files["c"]


def test_sft_stops_at_the_first_evaluation_that_reaches_the_target(tmp_path):
    """`warm_start.target_accuracy`: evaluated every `eval_every` steps (on the parameters
    trained so far), stopped at the first evaluation at or above the target; the model saved
    is the one evaluated there. Without the target: no evaluation until the end."""
    import json

    import numpy as np
    from pipelinerl_jax.launch.demonstrations import sft_on_demonstrations
    from pipelinerl_jax.models import flat_params, from_pretrained

    def evaluator(curve):
        calls = []

        def evaluate(model, step=0):
            params = {k: np.asarray(v).copy() for k, v in flat_params(model).items()}
            calls.append((step, params))
            return {"eval/accuracy": curve(step)}
        return evaluate, calls

    c = _config(steps=20, batch_size=4, log_every=1, target_accuracy=0.3, eval_every=4)
    c.learner.eval_size = 8
    run_config.validate(c)
    evaluate, calls = evaluator(lambda step: [0.0, 0.1, 0.25, 0.4, 0.9][step // 4 - 1])
    s = sft_on_demonstrations(run_config.resolve(c), str(tmp_path / "gated"), progress=False,
                evaluate=evaluate)
    assert [step for step, _ in calls] == [4, 8, 12, 16]  # 0.4 >= 0.3 at step 16: stop
    assert s["stopped_at"] == 16 and s["target_reached"] and s["eval/accuracy"] == 0.4
    saved = flat_params(from_pretrained(s["checkpoint"]))
    last = calls[-1][1]
    assert saved.keys() == last.keys()
    for k in last:
        np.testing.assert_array_equal(np.asarray(saved[k]), last[k])
    assert any(not np.array_equal(calls[0][1][k], last[k]) for k in last)
    rows = [json.loads(line) for line in open(tmp_path / "gated" / "sft_metrics.jsonl")]
    assert [r["sft/eval_accuracy"] for r in rows if "sft/eval_accuracy" in r] == \
        [0.0, 0.1, 0.25, 0.4]

    # Never reached: trains all `steps`, evaluates once more at the end, says so.
    evaluate, calls = evaluator(lambda step: 0.1)
    s = sft_on_demonstrations(run_config.resolve(c), str(tmp_path / "never"), progress=False,
                evaluate=evaluate)
    assert [step for step, _ in calls] == [4, 8, 12, 16, 20]
    assert s["stopped_at"] == 20 and s["target_reached"] is False

    # No target: one evaluation, at the end.
    c = _config(steps=6, batch_size=4, log_every=1)
    evaluate, calls = evaluator(lambda step: 0.5)
    s = sft_on_demonstrations(run_config.resolve(c), str(tmp_path / "plain"), progress=False,
                evaluate=evaluate)
    assert [step for step, _ in calls] == [6] and "target_reached" not in s


@pytest.mark.parametrize("warm, eval_size, key", [
    (dict(target_accuracy=1.5), 8, "warm_start.target_accuracy"),
    (dict(target_accuracy=-0.1), 8, "warm_start.target_accuracy"),
    (dict(target_accuracy=0.3, eval_every=0), 8, "warm_start.eval_every"),
])
def test_a_bad_target_is_refused_naming_its_key(warm, eval_size, key):
    c = _config(steps=20, **warm)
    c.learner.eval_size = eval_size
    with pytest.raises(ConfigError) as e:
        run_config.validate(c)
    assert e.value.key == key
