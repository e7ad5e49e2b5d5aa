"""The warm start's progress bar reads `sft_metrics.jsonl` while SFT writes it: with
`warm_start.eval_every` the last row can be an evaluation row, which has no loss (the main
job's quick start died on that KeyError, 2026-12-03)."""
import json

from pipelinerl_jax.launch.progress import SftProgress


def test_an_evaluation_row_last_keeps_the_bar_and_the_last_loss(tmp_path):
    rows = [{"step": 38, "sft/loss": 3.5}, {"step": 39, "sft/loss": 3.25},
            {"step": 39, "sft/eval_accuracy": 0.0}]
    (tmp_path / "sft_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bar = SftProgress(str(tmp_path), total=100)
    bar.update()
    assert bar.bar.n == 40 and bar.bar.postfix == "loss=3.250"
    bar.close(done=False)
