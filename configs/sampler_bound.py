"""A sampler-bound workload: long-tailed answers, larger groups, more engine slots (CPU).

    python experiments/train.py --config=configs/sampler_bound.py --workdir=runs/sampler_bound
    python experiments/train.py --config=configs/sampler_bound.py:quick --workdir=/tmp/sbq  # smoke

`configs/default.py` is learner-bound on this machine: its sync learner idles ~1/3 of the
time, which caps async at ~1.5x. Here the sync pipeline spends longer sampling than training,
as in real LLM RL where generation is most of a step: the same reversal task and model with a
heavier length tail (p99 96, cap 126 characters, against 69 / 96; the median stays 12, so the
300-step warm start still learns it: 49% held-out), 16 samples per prompt (128 per step) and
512 engine slots. `JaxEngine` decodes every slot at every step (a dense cache): a sync step
pays for every token of its slowest answer (batches whose longest answer is 100+ tokens are
common), while the learner's cost follows the packed token count, which the tail barely
moves. Async keeps the slots busy and overlaps the two. On this CPU a 512-slot decode step
costs more than a 128-slot one, so the sync baseline to beat is sync on an engine sized to
what it fills (`sync128` in configs/ablate/sampler_bound.py; docs/sampler_bound.md).

Design runs (20 steps from this config's warm start, on a machine shared with other jobs, so
absolute times are inflated; ratios within a run are what the design rests on): sync's
learner waited 1.85 s per step for its batch against 1.28 s training (59% idle, sampler slot
occupancy 2%); async (max_lag 2) trained at ~1.1 s per step, sync at ~2.3 s; held-out
accuracy 49% -> 74% in 20 steps either way. With 256 slots the same sync run sampled for
0.72 s against 1.11 s training (learner-bound), and 256 samples per step did not change that.
"""
from configs import default


def get_config(arg: str = ""):
    c = default.get_config()
    c.task.name = "reverse"
    c.task.median_length = 12  # the default's body, so the same warm start learns it ...
    c.task.p99_length = 96  # ... with a heavier tail (default p99 69, cap 96)
    c.task.max_length = 126
    c.sampling.max_new_tokens = 127  # longest answer + EOS
    # 128 prompt + 127 answer tokens fit the default model's 256
    c.engine.max_slots = 512  # 4 sync batches (8 prompts x 16): async fills them
    c.rollout.group_size = 16
    c.learner.batch_groups = 8
    c.learner.total_steps = 60
    c.learner.eval_every = 10
    c.learner.eval_size = 256
    c.learner.checkpoint_every = 30
    c.learner.keep_checkpoints = 1
    c.learner.optimizer.learning_rate = 1e-4
    c.warm_start.steps = 300
    c.warm_start.target_accuracy = 0.0  # its committed tables: the fixed 300 steps
    if arg == "quick":
        default.quick(c)
        c.rollout.group_size = 8
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick')")
    return c
