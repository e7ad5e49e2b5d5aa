"""`metrics.read_metrics`: the learner's rows with the evaluator's records merged into the row
of their step, which is how the launcher's summary, the plot, the progress bar and the
ablation results see `eval/*`."""
import json

from pipelinerl_jax.ablation.results import load_run
from pipelinerl_jax.launch.progress import Monitor
from pipelinerl_jax.metrics import eval_on_learner_step, merge_evals, read_metrics


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_records_join_the_row_of_their_step():
    rows = [{"step": 0, "version": 0, "wall_time_s": 0.0},
            {"step": 1, "version": 1, "wall_time_s": 1.0, "reward/mean": 0.1},
            {"step": 2, "version": 2, "wall_time_s": 2.0, "reward/mean": 0.2}]
    evals = [{"step": 2, "time_unix": 99.0, "version": 2, "eval/accuracy": 0.5},
             {"step": 0, "time_unix": 98.0, "version": 0, "eval/accuracy": 0.25}]
    merged = merge_evals(rows, evals)
    assert [r["step"] for r in merged] == [0, 1, 2]
    assert merged[0]["eval/accuracy"] == 0.25 and merged[2]["eval/accuracy"] == 0.5
    assert merged[2]["reward/mean"] == 0.2 and merged[2]["wall_time_s"] == 2.0
    assert "time_unix" not in merged[2] and "eval/accuracy" not in merged[1]
    assert "eval/accuracy" not in rows[2]  # the input is left as it was


def test_a_version_trained_twice_keeps_its_newest_row_and_record():
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},  # a learner restarted at 1
            {"step": 2, "loss": 2.5}, {"step": 3, "loss": 3.0}]
    evals = [{"step": 2, "eval/accuracy": 0.1}, {"step": 2, "eval/accuracy": 0.2},
             {"step": 4, "eval/accuracy": 0.9}]  # no learner row (yet): a row of its own
    merged = merge_evals(rows, evals)
    assert [r.get("eval/accuracy") for r in merged] == [None, None, 0.2, None, 0.9]
    assert [r["step"] for r in merged] == [1, 2, 2, 3, 4]


def test_readers_of_a_run_directory_see_the_merged_table(tmp_path, capsys):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 0, "version": 0, "wall_time_s": 0.0},
        {"step": 1, "version": 1, "wall_time_s": 1.5, "reward/mean": 0.3}])
    assert eval_on_learner_step(str(tmp_path))  # no eval.jsonl: an older run's layout
    _write(tmp_path / "eval.jsonl", [
        {"step": 0, "version": 0, "eval/accuracy": 0.25, "eval/time_s": 4.0},
        {"step": 1, "version": 1, "eval/accuracy": 0.75, "eval/time_s": 4.0}])
    (tmp_path / "config.json").write_text(json.dumps({"learner": {"eval_every": 1}}))
    assert not eval_on_learner_step(str(tmp_path))
    assert [r.get("eval/accuracy") for r in read_metrics(str(tmp_path))] == [0.25, 0.75]
    run = load_run(str(tmp_path))
    assert run.evals == [(0, 0.0, 0.25), (1, 1.5, 0.75)]
    monitor = Monitor(str(tmp_path), total=1)
    monitor.update()
    assert monitor.last["eval/accuracy"] == 0.75 and monitor.last["step"] == 1
    monitor.close()


def test_the_progress_summary_shows_the_train_inference_mismatch(tmp_path):
    _write(tmp_path / "metrics.jsonl",
           [{"step": 1, "version": 1, "reward/mean": 0.5, "loss/mismatch/abs_mean": 0.0015}])
    monitor = Monitor(str(tmp_path), total=2)
    monitor.update()
    assert "mismatch=0.0015" in monitor.bar.postfix and "reward=0.500" in monitor.bar.postfix
    monitor.close()
