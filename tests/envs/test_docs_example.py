"""The example environment of docs/environments.md runs as printed."""
import itertools
import os
import re

import numpy as np

from pipelinerl_jax.envs import EpisodeRunner, ModelTurn, run_group
from tests.envs.conftest import check_token_exact, replay_policy
from tests.envs.scripted_engine import ScriptedEngine

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "environments.md")


def test_docs_example_environment(tok):
    code = re.findall(r"```python\n(.*?)```", open(DOC, encoding="utf-8").read(), re.S)[0]
    assert len(code.strip().splitlines()) <= 40
    ns = {}
    exec(compile(code, "docs/environments.md", "exec"), ns)  # noqa: S102 - our own docs
    task = ns["ReverseToolTask"]()
    problems = list(itertools.islice(task.problems(0), 8)) + task.eval_problems(2)
    for p in problems:
        assert task.reward(p, task.demonstration(p)).correct
        assert len(p.prompt) <= task.max_prompt_chars
        assert len(task.demonstration(p)) + 1 <= task.max_completion_tokens
    eng = ScriptedEngine(replay_policy(task, tok, problems))
    runner = EpisodeRunner(eng, tok, task)
    for ep in runner.run(problems):
        assert ep.status == "done" and ep.correct and len(ep.turns) == 2
        check_token_exact(ep, eng, tok)
    g = run_group(runner, problems[0], 3)
    assert g.ok and g.rewards.tolist() == [1.0, 1.0, 1.0]
    env = ns["ReverseToolEnv"](task, problems[0])
    reply = env.step(ModelTurn(0, np.zeros(1, np.int32), "hello;", ";", False))
    assert reply.text == "=error\n"
