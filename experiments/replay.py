"""Replay a recorded run's batches through another loss (docs/replay.md):

    python experiments/replay.py --recording=runs/async --config=configs/default.py \
        --workdir=runs/async_replay_ppo --config.loss.name=ppo

The recording is a run trained with `--config.learner.record_batches=True`. The config should
be the recorded run's (same model, minibatches, optimizer) with the changes under study;
`workdir/replay.json` lists every learner-relevant key that differs from the recording.
"""
import json
import os
import sys

# configs/*.py import the `configs` package: the repo root must be importable
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.config_checks import ConfigError  # noqa: E402
from pipelinerl_jax.launch.supervisor import exit_now  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Experiment config.",
                                          lock_config=True)
_RECORDING = flags.DEFINE_string("recording", None, "Recorded run directory (or its recorded/).",
                                 required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (metrics.jsonl, replay.json).",
                               required=True)
_INIT = flags.DEFINE_string("init_checkpoint", None,
                            "Initial model (default: the one the recording names).")


def main(argv):
    del argv
    from pipelinerl_jax import compile_cache, run_config
    from pipelinerl_jax.launch.roles import pin
    cfg = _CONFIG.value
    try:
        run_config.validate(cfg)
    except ConfigError as e:
        raise app.UsageError(f"invalid config: {e}") from None
    cfg = run_config.resolve(cfg)  # the derived values every role reads
    pin(cfg, "learner")  # the cores a launched learner would have
    compile_cache.enable()
    from pipelinerl_jax.learner import recording
    from pipelinerl_jax.learner.replay import run_replay
    from pipelinerl_jax.rollout.evaluator import embedded_evaluator
    init = _INIT.value or recording.read_meta(
        recording.recording_dir(_RECORDING.value))["init_checkpoint"]
    evaluate = embedded_evaluator(cfg, init)
    try:
        summary = run_replay(cfg, _RECORDING.value, _WORKDIR.value, init, evaluate=evaluate)
    except ConfigError as e:
        raise app.UsageError(f"config does not fit the recording: {e}") from None
    finally:
        if evaluate is not None:
            evaluate.close()
    print(json.dumps(summary, indent=2, default=str))
    exit_now(0)  # skips tearing down jax & co. at exit (see exit_now)


if __name__ == "__main__":
    app.run(main)
