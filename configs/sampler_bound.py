"""A sampler-bound workload: long-tailed answers, larger groups, more engine slots (CPU).

    python experiments/train.py --config=configs/sampler_bound.py --workdir=runs/sampler_bound
    python experiments/train.py --config=configs/sampler_bound.py:quick --workdir=/tmp/sbq  # smoke

`configs/default.py` is learner-bound on this machine: its sync learner idles ~1/3 of the
time, which caps async at ~1.5x. Here the sync pipeline spends at least as long sampling as
training, as in real LLM RL where generation is most of a step: the same reversal task with
a much heavier length tail (median 16, p99 128, cap 224 characters), 16 samples per prompt
and 128 engine slots. A sync step waits for its slowest answer (up to 225 sequential decode
steps at a 512-token attention bucket), while the learner's cost follows the packed token
count, which the tail barely moves. Async keeps the slots busy and overlaps the two.
"""
from configs import default


def get_config(arg: str = ""):
    c = default.get_config()
    c.task.name = "reverse"
    c.task.median_length = 16
    c.task.p99_length = 128
    c.task.max_length = 224
    c.sampling.max_new_tokens = 225  # longest answer + EOS
    c.model.max_seq_len = 512  # 226 prompt + 225 answer tokens
    c.engine.max_seq_len = 512
    c.engine.max_slots = 128  # one sync batch (8 prompts x 16) fits at once
    c.rollout.group_size = 16
    c.learner.batch_groups = 8
    c.learner.total_steps = 60
    c.learner.eval_every = 10
    c.learner.eval_size = 256
    c.learner.checkpoint_every = 30
    c.learner.keep_checkpoints = 1
    c.learner.optimizer.learning_rate = 1e-4
    c.warm_start.steps = 300
    if arg == "quick":  # a minute-scale smoke run of the same pipeline
        c.warm_start.steps = 30
        c.learner.total_steps = 6
        c.learner.eval_every = 3
        c.learner.eval_size = 16
        c.learner.checkpoint_every = 3
        c.learner.batch_groups = 2
        c.rollout.group_size = 8
        c.engine.max_slots = 16
    elif arg:
        raise ValueError(f"unknown config argument {arg!r} (valid: '', 'quick')")
    return c
