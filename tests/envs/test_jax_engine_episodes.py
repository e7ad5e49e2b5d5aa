"""Multi-turn episodes on a real `JaxEngine` with a tiny random model: the sequence is the
engine's tokens plus the env's, each model token's log-prob is the learner's recompute on
that very sequence, and turns on either side of a weight update carry the right versions."""
import threading
import time

import pytest

from pipelinerl_jax.envs import EpisodeRunner
from pipelinerl_jax.models import flat_params
from tests.envs.conftest import (RANDOM_MODEL_STOPS, ToyTask, check_logps, check_token_exact,
                                 default_behaviour, recording, toy_problem)
from tests.rollout.conftest import full_logits, make_engine, make_model, reference  # noqa: F401

ENV_TEXTS = ["=0\n", "=1\n", "=2\n"]


@pytest.fixture(scope="module")
def weights():
    return {0: make_model(100), 1: make_model(101)}


def test_episodes_are_token_exact_on_a_real_engine(tok, weights, reference):  # noqa: F811
    eng = recording(make_engine(weights[0], start=True))
    runner = EpisodeRunner(eng, tok, ToyTask(), max_turn_tokens=12, stop_token_ids=RANDOM_MODEL_STOPS,
                           tool_threads=4)
    try:
        eps = runner.run([toy_problem(i, turns=3) for i in range(8)], seeds=list(range(8)),
                         timeout=300)
    finally:
        runner.close()
        eng.close()
    multi = [e for e in eps if len(e.turns) >= 2]
    assert len(multi) >= 2, [e.end_reason for e in eps]
    for ep in eps:
        assert ep.status in ("done", "truncated"), ep.detail
        check_token_exact(ep, eng, tok, env_texts=ENV_TEXTS)
        assert (ep.version == 0).all() and (ep.kv_version == 0).all()
    for ep in multi:
        check_logps(ep, weights[0], reference, turns=list(range(len(ep.turns))))


def test_an_episode_spanning_a_weight_update(tok, weights, reference):  # noqa: F811
    """Every first tool call waits until version 1 is live: turn 0 was sampled by version 0,
    later turns by version 1 (re-prefilled with it), exactly as the engine reported."""
    gate = threading.Event()

    def behaviour(problem, turn):
        if turn.index == 0:
            gate.wait(60)
        return default_behaviour(problem, turn)

    eng = recording(make_engine(weights[0], start=True))
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour), max_turn_tokens=12,
                           stop_token_ids=RANDOM_MODEL_STOPS, tool_threads=8)
    ids = [runner.start(toy_problem(i, turns=3), seed=100 + i) for i in range(6)]
    done, updated = [], False
    t_end = time.monotonic() + 300
    try:
        while len(done) < len(ids) and time.monotonic() < t_end:
            done += runner.poll(timeout=0.02)
            if not updated and runner.stats()["waiting_on_tools"] + len(done) == len(ids):
                eng.update_weights(flat_params(weights[1]), 1)  # returns once live
                gate.set()
                updated = True
    finally:
        gate.set()
        runner.close()
        eng.close()
    assert updated and len(done) == len(ids)
    spanning = [e for e in done if len(e.turns) >= 2]
    assert spanning, [e.end_reason for e in done]
    for ep in done:
        comps = check_token_exact(ep, eng, tok, env_texts=ENV_TEXTS)
        for rec, c in zip(ep.turns, comps):
            want = 0 if rec.index == 0 else 1
            assert (c.version == want).all() and (c.kv_version == want).all()
            assert (rec.version_min, rec.version_max, rec.start_version) == (want, want, want)
    for ep in spanning:
        assert sorted(set(ep.version[ep.loss_mask == 1].tolist())) == [0, 1]
        check_logps(ep, weights[0], reference, turns=[0])
        check_logps(ep, weights[1], reference, turns=list(range(1, len(ep.turns))))
