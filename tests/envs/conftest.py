"""Shared pieces of the environment tests: a toy environment whose behaviour each test sets,
a policy that replays a task's demonstrations, and the token-exactness check."""
import numpy as np
import pytest

from pipelinerl_jax.envs import EnvReply, EnvTask, Environment
from pipelinerl_jax.tasks.base import Problem
from pipelinerl_jax.tokenizer import CharTokenizer


class ToyEnv(Environment):
    def __init__(self, task, problem):
        self.task, self.problem = task, problem

    def step(self, turn):
        return self.task.behaviour(self.problem, turn)


def default_behaviour(problem, turn):
    """Answers '=<turn index>' until the episode's last turn, then done with its reward."""
    if turn.index + 1 < problem.meta.get("turns", 2):
        return EnvReply.say(f"={turn.index}\n")
    return EnvReply.finish(problem.meta.get("reward", 1.0), correct=True)


class ToyTask(EnvTask):
    """Problems are made by `toy_problem`; `behaviour(problem, turn)` is the environment."""
    name = "toy"
    turn_stop_texts = (";",)
    max_prompt_chars = 16
    max_completion_tokens = 64
    default_max_turns = 8

    def __init__(self, behaviour=default_behaviour):
        self.behaviour = behaviour

    def _generate(self, rng):
        return "ab=", "x", {}

    def make_env(self, problem):
        return ToyEnv(self, problem)

    def demonstration_turns(self, problem):
        return [("x", "")]

    def score_answer(self, problem, answer):
        return float(answer == "x"), answer == "x", {}


def toy_problem(i, turns=2, reward=1.0, **meta):
    return Problem(f"toy/i{i}", "ab=", "x", {"turns": turns, "reward": reward, **meta})


def say_go(tok):
    """A policy that always makes a tool call 'go;'."""
    ids = tok.encode("go;")
    return lambda req, i: ids


def replay_policy(task, tok, problems):
    """A policy that plays each problem's demonstration: it reads the episode so far from the
    prompt and emits the next model turn (EOS after the last)."""
    by_prompt = {}
    for p in problems:
        by_prompt.setdefault(p.prompt, []).append(p)

    def policy(req, i):
        text = tok.decode(req.prompt_ids)
        for prompt, ps in by_prompt.items():
            if not text.startswith(prompt):
                continue
            done = text[len(prompt):]
            for p in ps:
                turns = task.demonstration_turns(p)
                so_far = ""
                for k, (m, e) in enumerate(turns):
                    if so_far == done:
                        last = k == len(turns) - 1
                        return tok.encode(m) + ([tok.eos_id] if last else [])
                    so_far += m + e
        return tok.encode("???")
    return policy


def check_token_exact(ep, engine, tok, env_texts=None):
    """The episode is exactly the engine's tokens plus the env tokens, with masks and
    provenance right; returns the completions of its turns."""
    by_rid = {c.request_id: c for c in engine.returned}
    subs = {r.request_id: r for r in engine.submitted}
    C = len(ep.completion_ids)
    for a in (ep.loss_mask, ep.logp_behaviour, ep.version, ep.kv_version, ep.turn_index):
        assert a.shape == (C,)
    pos, comps = 0, []
    for k, rec in enumerate(ep.turns):
        c = by_rid[rec.request_id]
        comps.append(c)
        assert rec.start == pos
        seq_so_far = np.concatenate([ep.prompt_ids, ep.completion_ids[:pos]])
        np.testing.assert_array_equal(subs[rec.request_id].prompt_ids, seq_so_far)
        m = slice(pos, pos + len(c.token_ids))
        np.testing.assert_array_equal(ep.completion_ids[m], c.token_ids)
        np.testing.assert_array_equal(ep.logp_behaviour[m], c.logp_behaviour)
        np.testing.assert_array_equal(ep.version[m], c.version)
        np.testing.assert_array_equal(ep.kv_version[m], c.kv_version)
        assert (ep.loss_mask[m] == 1).all() and (ep.turn_index[m] == k).all()
        assert rec.start_version == c.start_version and rec.finish_reason == c.finish_reason
        pos = m.stop
        e = slice(pos, pos + rec.env_tokens)
        assert (ep.loss_mask[e] == 0).all() and (ep.logp_behaviour[e] == 0).all()
        assert (ep.turn_index[e] == k).all()
        if rec.env_tokens:  # neutral provenance: the previous model token's
            assert (ep.version[e] == c.version[-1]).all()
            assert (ep.kv_version[e] == c.kv_version[-1]).all()
        if env_texts is not None and rec.env_tokens:
            np.testing.assert_array_equal(ep.completion_ids[e], tok.encode(env_texts[k]))
        pos = e.stop
    assert pos == C
    return comps


# EOS, '\n' and the ids the random test model (tests/rollout make_model(100)) samples most,
# so that its turns end by a stop token.
RANDOM_MODEL_STOPS = (2, 4, 6, 9, 10, 17, 18, 49)


def recording(engine):
    """Keeps every request the engine got and every completion it returned."""
    engine.submitted, engine.returned = [], []
    submit, get = engine.submit, engine.get_completions

    def rec_submit(request):
        submit(request)
        engine.submitted.append(request)

    def rec_get(timeout=0.0, max_items=None):
        out = get(timeout, max_items)
        engine.returned.extend(out)
        return out
    engine.submit, engine.get_completions = rec_submit, rec_get
    return engine


def check_logps(ep, model, reference, turns):
    """logp_behaviour of the model tokens of `turns` equals one full forward of `model` over
    the episode's sequence (env tokens included as context)."""
    ref = reference(model, ep.prompt_ids, ep.completion_ids)
    at = (ep.loss_mask == 1) & np.isin(ep.turn_index, turns)
    assert at.any()
    np.testing.assert_allclose(ep.logp_behaviour[at], ref[at], atol=2e-4)


@pytest.fixture(scope="session")
def tok():
    return CharTokenizer()
