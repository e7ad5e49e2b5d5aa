"""The two group sources alone (rollout/group_source.py), over the scripted engine: n samples
of one prompt as one request handed over with its round, groups of episodes over the real
GroupRunner; each finished group yields what the scorer needs, or a failure."""
import time

import numpy as np
import pytest

from pipelinerl_jax.envs import CalculatorTask, GroupRunner, make_runner
from pipelinerl_jax.rollout.admission import Ticket
from pipelinerl_jax.rollout.engine import RequestError
from pipelinerl_jax.rollout.group_source import EpisodeGroups, SampleGroups
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.tasks import get_task
from pipelinerl_jax.tasks.base import Problem
from pipelinerl_jax.tokenizer import CharTokenizer
from tests.envs.scripted_engine import ScriptedEngine

SAMPLING = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0)


class RecordingEngine(ScriptedEngine):
    """Records how requests arrive (one `submit_batch` per round) and can refuse one."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batches, self.refuse = [], None

    def submit_batch(self, requests):
        self.batches.append([r.request_id for r in requests])
        super().submit_batch(requests)

    def get_completions(self, timeout=0.0, max_items=None):
        if self.refuse is not None:
            rid, self.refuse = self.refuse, None
            raise RequestError(f"request {rid!r}: malformed answer", request_id=rid)
        return super().get_completions(timeout, max_items)


def poll_until(source, n, timeout_s=10.0):
    out, end = [], time.time() + timeout_s
    while len(out) < n and time.time() < end:
        out += source.poll(timeout=0.02)
    return out


def test_n_samples_of_one_prompt_per_group():
    tok = CharTokenizer()
    # sample i of a request answers i+1 tokens, then EOS; sample 2 runs into max_new_tokens
    engine = RecordingEngine(lambda req, i: [5] * (i + 1) + ([tok.eos_id] if i < 2 else [5] * 9),
                             vocab_size=tok.vocab_size)
    source = SampleGroups(engine, tok, task_id="t", group_size=3, sampling=SAMPLING)
    problems = [Problem("a", "12+3=", 15), Problem("b", "7*7=", 49)]
    tickets = [Ticket(f"w0-n-{k}", 100 + k, 0, p) for k, p in enumerate(problems)]
    for t in tickets:
        source.start(t)
    assert engine.submitted == []  # nothing reaches the engine before the round is complete
    source.submit()
    source.submit()  # an empty round submits nothing
    assert engine.batches == [["w0-n-0", "w0-n-1"]]
    for t, req in zip(tickets, engine.submitted):
        assert req.params.n == 3 and req.params.seed == t.seed
        assert req.params.stop_token_ids == (tok.eos_id,) and req.params.max_new_tokens == 6
        np.testing.assert_array_equal(req.prompt_ids, tok.encode_prompt(t.problem.prompt))
    groups = sorted(poll_until(source, 2), key=lambda g: g.group_id)
    assert [(g.group_id, g.problem, g.failure, g.counted_as) for g in groups] == [
        (t.group_id, t.problem, None, None) for t in tickets]
    for g in groups:
        assert [m.completion.sample_index for m in g.members] == [0, 1, 2]
        assert [(m.length, m.truncated) for m in g.members] == [(2, False), (3, False),
                                                                 (6, True)]
    assert source.stats() == {}


def test_a_refused_request_ends_its_group_and_a_stranger_is_raised():
    tok = CharTokenizer()
    engine = RecordingEngine(lambda req, i: [tok.eos_id], vocab_size=tok.vocab_size, delay=5.0)
    source = SampleGroups(engine, tok, task_id="t", group_size=2, sampling=SAMPLING)
    problem = Problem("a", "1+1=", 2)
    source.start(Ticket("w0-n-0", 1, 0, problem))
    source.submit()
    engine.refuse = "w0-n-0"
    [g] = source.poll(timeout=0.0)
    assert (g.group_id, g.problem, g.members) == ("w0-n-0", problem, [])
    assert "malformed answer" in g.failure
    engine.refuse = "w0-n-0"  # no longer ours
    with pytest.raises(RequestError, match="malformed"):
        source.poll(timeout=0.0)


class FlakyCalculator(CalculatorTask):
    def make_env(self, problem):
        if problem.meta.get("broken"):
            raise RuntimeError("no calculator today")
        return super().make_env(problem)


def test_a_group_of_episodes_per_problem():
    tok = CharTokenizer()
    cfg = base_config()
    cfg.task.name = "calculator"
    cfg.env.max_episode_tokens = 128
    task = FlakyCalculator()
    engine = ScriptedEngine(lambda req, i: tok.encode("0") + [tok.eos_id],
                            vocab_size=tok.vocab_size, max_seq_len=128)
    source = EpisodeGroups(GroupRunner(make_runner(cfg.env, engine, tok, task=task), 2))
    problems = task.problems(1)
    good, broken = next(problems), next(problems)
    broken.meta["broken"] = True
    source.start(Ticket("w0-n-0", 11, 0, good))
    source.start(Ticket("w0-n-1", 12, 0, broken))
    source.submit()
    try:
        groups = {g.group_id: g for g in poll_until(source, 2)}
    finally:
        source.close()
    ok, failed = groups["w0-n-0"], groups["w0-n-1"]
    assert ok.failure is None and ok.counted_as == "episodes" and ok.problem is good
    assert [m.episode.index for m in ok.members] == [0, 1]
    for m in ok.members:
        judged = m.judge(task, tok, good)  # the environment rewarded it
        assert (judged.reward, judged.correct) == (m.episode.reward, m.episode.correct)
        assert m.length == 2 and not m.truncated
        fields = m.rollout_fields(judged, 0.5, 2, "w0-n-0")
        assert fields["group_id"] == "w0-n-0" and fields["advantage"] == 0.5
        assert fields["metrics"][f"end/{m.episode.end_reason}"] == 1.0
        assert fields["loss_mask"].tolist() == [1, 1]
    assert failed.members == [] and "no calculator today" in failed.failure
    assert source.stats()["env"]["episodes_finished"] >= 2


def test_a_completion_member_is_judged_by_the_task():
    tok = CharTokenizer()
    task = get_task(base_config().task)
    problem = next(task.problems(3))
    engine = ScriptedEngine(lambda req, i: tok.encode(str(problem.answer)) + [tok.eos_id]
                            if i == 0 else tok.encode("x") + [tok.eos_id],
                            vocab_size=tok.vocab_size, max_seq_len=256)
    source = SampleGroups(engine, tok, task_id=task.name, group_size=2,
                          sampling=dict(SAMPLING, max_new_tokens=64))
    source.start(Ticket("g", 1, 0, problem))
    source.submit()
    [g] = poll_until(source, 1)
    right, wrong = (m.judge(task, tok, problem) for m in g.members)
    expected = task.reward(problem, str(problem.answer))
    assert (right.reward, right.correct) == (expected.reward, expected.correct)
    assert not wrong.correct
    fields = g.members[0].rollout_fields(right, 1.0, 2, "g")
    assert fields["task_id"] == task.name and fields["metrics"] == {
        "correct": float(right.correct)}
    record = g.members[1].log_record(wrong)
    assert record["response_length"] == 2 and record["finish_reason"] == "stop"
