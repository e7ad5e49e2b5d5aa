"""Process orchestration: a run's queue server, rollout workers and learner as processes.

    launch(config, workdir)          # what experiments/train.py calls

| module | job |
|---|---|
| `launcher.py` | `launch()`: one run, start to end (config, warm start, children, restarts) |
| `supervisor.py` | child processes: own log, new session, restarts, `events.jsonl`, ordered stop |
| `warm_start.py` | the checkpoint RL starts from (SFT in a child process when needed) |
| `roles.py` | the child entry points: queue, learner, worker, sft |
| `learner_group.py` | a learner of `launch.learner_processes` processes, supervised as one |
| `standalone.py` | a role started on its own (`--config=...`), without the launcher |
| `outcome.py` | the structured record of how a learner stopped (e.g. diverged) |
| `progress.py` | progress bars over `metrics.jsonl` and the SFT metrics |

A role runs on its own as `python -m pipelinerl_jax.launch --role=ROLE --workdir=DIR
[--config=FILE ...]` (docs/multihost.md).
The ablation runner supervises its runs and shares one warm start with the same modules.
"""
from pipelinerl_jax.launch.launcher import launch
from pipelinerl_jax.launch.supervisor import LaunchError

__all__ = ["launch", "LaunchError"]
