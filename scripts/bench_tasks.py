"""Throughput of the task side of a rollout: problem generation, tokenisation, verification.

A rollout worker calls `task.reward` once per sample and the tokenizer twice; this measures
that none of them can bottleneck sampling. Prints one final JSON line:

    PYTHONPATH=. python scripts/bench_tasks.py [--n=20000]
"""
import argparse
import itertools
import json
import time

import numpy as np

from pipelinerl_jax.tasks import get_task, task_config
from pipelinerl_jax.tokenizer import CharTokenizer


def rate(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return len(items) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20_000)
    n = parser.parse_args().n
    tok, results = CharTokenizer(), {}
    garbage_rng = np.random.default_rng(0)
    for name in ("reverse", "countdown"):
        task = get_task(task_config(name))
        start = time.perf_counter()
        pairs = list(itertools.islice(task.demonstrations(0), n))
        results[f"{name}_problems_per_s"] = n / (time.perf_counter() - start)
        results[f"{name}_reward_correct_per_s"] = rate(lambda pt: task.reward(*pt), pairs)
        # Wrong answers of realistic length: the target with its characters shuffled.
        wrong = [(p, "".join(garbage_rng.permutation(list(t)))) for p, t in pairs]
        results[f"{name}_reward_wrong_per_s"] = rate(lambda pt: task.reward(*pt), wrong)
        results[f"{name}_char_encode_per_s"] = rate(
            lambda pt: tok.encode_prompt(pt[0].prompt) + tok.encode_completion(pt[1]), pairs)
    print(json.dumps({"bench": "tasks", "n": n,
                      **{k: round(v) for k, v in results.items()}}))


if __name__ == "__main__":
    main()
