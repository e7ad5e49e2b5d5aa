"""EpisodeRunner on a scripted engine: token-exact sequences, provenance across weight
updates, limits, engine-side failures, concurrency, and the wire fields."""
import dataclasses
import itertools
import threading
import time

import numpy as np
import pytest

from pipelinerl_jax import records
from pipelinerl_jax.envs import (CalculatorTask, EnvReply, EpisodeRunner, KVLookupTask,
                                 encode_demonstration)
from pipelinerl_jax.transport import codec
from tests.envs.conftest import (ToyTask, check_token_exact, default_behaviour, replay_policy,
                                 say_go, toy_problem)
from tests.envs.scripted_engine import ScriptedEngine


def test_multi_turn_episode_is_engine_tokens_plus_env_tokens(tok):
    eng = ScriptedEngine(say_go(tok), delay=0.005)
    runner = EpisodeRunner(eng, tok, ToyTask(), tool_threads=2)
    ep, = runner.run([toy_problem(0, turns=3, reward=0.5)])
    assert (ep.status, ep.end_reason, ep.reward, ep.correct) == ("done", "done", 0.5, True)
    assert len(ep.turns) == 3 and [t.outcome for t in ep.turns] == ["say", "say", "done"]
    check_token_exact(ep, eng, tok, env_texts=["=0\n", "=1\n"])
    assert tok.decode(ep.completion_ids) == "go;=0\ngo;=1\ngo;"
    np.testing.assert_array_equal(ep.prompt_ids, tok.encode_prompt("ab="))
    assert ep.model_tokens == 9 and len(ep.completion_ids) == 15
    assert all(t.tool_latency_s is not None and t.tool_latency_s >= 0 for t in ep.turns)
    s = runner.stats()
    assert (s["turns"], s["tool_calls"], s["model_tokens"], s["env_tokens"]) == (3, 3, 9, 6)
    assert s["end.done"] == 1 and s["active_episodes"] == 0
    runner.close()


@pytest.mark.parametrize("task", [CalculatorTask(), KVLookupTask()], ids=lambda t: t.name)
def test_replayed_demonstrations_score_one_and_match_their_encoding(task, tok):
    problems = list(itertools.islice(task.problems(0), 12)) + task.eval_problems(4)
    eng = ScriptedEngine(replay_policy(task, tok, problems), delay=0.002)
    runner = EpisodeRunner(eng, tok, task, tool_threads=4)
    for ep, p in zip(runner.run(problems), problems):
        assert ep.status == "done" and ep.correct and ep.reward == 1.0, (p, ep.end_reason)
        prompt, ids, mask = encode_demonstration(task, tok, p)
        np.testing.assert_array_equal(ep.prompt_ids, prompt)
        np.testing.assert_array_equal(ep.completion_ids, ids)
        np.testing.assert_array_equal(ep.loss_mask, mask)
        check_token_exact(ep, eng, tok)
        assert len(ep.turns) == len(task.demonstration_turns(p))
    runner.close()


def test_turns_carry_exactly_the_versions_the_engine_reported(tok):
    """Turn 1 is in flight across an update (its tokens carry 0 then 1); turn 2 starts after
    it; a second update lands while turn 2's tool runs, so turn 3 is all version 2."""
    gate = threading.Event()

    def behaviour(problem, turn):
        if turn.index == 2:
            gate.wait(5)
        return default_behaviour(problem, turn)

    eng = ScriptedEngine(say_go(tok), delay=lambda r: 3600 if r.request_id.endswith("/t1") else 0)
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour), tool_threads=4)
    ids = [runner.start(toy_problem(i, turns=4), seed=i) for i in range(3)]
    done, stage = [], 0
    t_end = time.monotonic() + 10
    while len(done) < 3 and time.monotonic() < t_end:
        done += runner.poll(timeout=0.01)
        if stage == 0 and sum(r.request_id.endswith("/t1") for r in eng.submitted) == 3:
            eng.update_weights(None, 1)  # turn 1 is in flight everywhere
            eng.release(lambda r: True)
            stage = 1
        elif stage == 1 and runner.stats()["waiting_on_tools"] == 3 and \
                sum(r.request_id.endswith("/t2") for r in eng.submitted) == 3:
            eng.update_weights(None, 2)
            gate.set()
            stage = 2
    assert sorted(e.episode_id for e in done) == sorted(ids)
    for ep in done:
        comps = check_token_exact(ep, eng, tok, env_texts=["=0\n", "=1\n", "=2\n"])
        per_turn = [sorted(set(c.version.tolist())) for c in comps]
        assert per_turn == [[0], [0, 1], [1], [2]]
        assert [(t.version_min, t.version_max, t.start_version) for t in ep.turns] == \
            [(0, 0, 0), (0, 1, 0), (1, 1, 1), (2, 2, 2)]
        assert ep.start_version == 0
    runner.close()


def test_limits_end_episodes_as_truncated(tok):
    eng = ScriptedEngine(say_go(tok))
    task = ToyTask()
    task.truncated_reward = -0.5
    runner = EpisodeRunner(eng, tok, task, max_turns=3, tool_threads=2)
    ep, = runner.run([toy_problem(0, turns=10)])
    assert (ep.status, ep.end_reason, ep.reward, len(ep.turns)) == ("truncated", "max_turns",
                                                                     -0.5, 3)
    assert ep.turns[-1].env_tokens == 0 and ep.turns[-1].outcome == "max_turns"
    assert tok.decode(ep.completion_ids) == "go;=0\ngo;=1\ngo;"  # the last reply is not appended

    # 4 prompt + 3 + 3 env = 10; turn 2 may take 2 tokens and is cut at the episode budget
    runner = EpisodeRunner(eng, tok, ToyTask(), max_episode_tokens=12)
    ep, = runner.run([toy_problem(1, turns=10)])
    assert (ep.status, ep.end_reason) == ("truncated", "max_tokens")
    assert len(ep.prompt_ids) + len(ep.completion_ids) == 12
    assert ep.turns[-1].finish_reason == "length"

    runner = EpisodeRunner(eng, tok, ToyTask(), max_turn_tokens=2)
    ep, = runner.run([toy_problem(2)])
    assert (ep.status, ep.end_reason, len(ep.completion_ids)) == ("truncated", "turn_length", 2)

    small = ScriptedEngine(say_go(tok), max_seq_len=12)  # the engine's context bounds episodes
    runner = EpisodeRunner(small, tok, ToyTask(), max_episode_tokens=1000)
    assert runner.max_episode_tokens == 12
    ep, = runner.run([toy_problem(3, turns=10)])
    assert ep.end_reason == "max_tokens"

    # an env reply that would leave no room for a model token ends the episode before it
    runner = EpisodeRunner(eng, tok, ToyTask(), max_episode_tokens=10)
    ep, = runner.run([toy_problem(4, turns=10)])
    assert ep.end_reason == "max_tokens" and tok.decode(ep.completion_ids) == "go;"


def test_engine_side_failures_end_only_their_episode(tok):
    eng = ScriptedEngine(say_go(tok), delay=lambda r: 3600 if "victim" in r.request_id else 0.01)
    runner = EpisodeRunner(eng, tok, ToyTask())
    runner.start(toy_problem(0), episode_id="victim")
    runner.start(toy_problem(1, prompt_note="x"), episode_id="fine")
    runner.start(dataclasses.replace(toy_problem(2), prompt="a" * 300),  # over the context
                 episode_id="too-long")
    runner.start(dataclasses.replace(toy_problem(3), prompt="<tag>"),  # not in the vocabulary
                 episode_id="bad-prompt")
    eng.abort("victim/t0")
    got = {}
    t_end = time.monotonic() + 5
    while len(got) < 4 and time.monotonic() < t_end:
        got.update({e.episode_id: e for e in runner.poll(timeout=0.02)})
    assert got["victim"].end_reason == "aborted" and got["victim"].status == "failed"
    assert got["too-long"].end_reason == "prompt_too_long"
    assert got["bad-prompt"].end_reason == "bad_prompt"
    assert got["fine"].status == "done"
    s = runner.stats()
    assert (s["end.aborted"], s["end.prompt_too_long"], s["end.bad_prompt"], s["end.done"]) == \
        (1, 1, 1, 1)
    # the engine refuses a turn (ids outside its vocabulary): that episode fails, counted
    refusing = EpisodeRunner(ScriptedEngine(say_go(tok), vocab_size=20), tok, ToyTask())
    ep, = refusing.run([toy_problem(4)])
    assert ep.end_reason == "request_error" and "prompt_ids" in ep.detail
    assert refusing.stats()["end.request_error"] == 1


def test_cancel_aborts_the_turn_and_drops_the_episode(tok):
    eng = ScriptedEngine(say_go(tok), delay=3600)
    runner = EpisodeRunner(eng, tok, ToyTask())
    runner.start(toy_problem(0), episode_id="e")
    assert runner.cancel("e") and not runner.cancel("e")
    assert eng.aborted == ["e/t0"]
    assert runner.poll(timeout=0.05) == []  # its abort completion is dropped
    assert runner.stats()["episodes_cancelled"] == 1 and runner.stats()["stray_completions"] == 1


@pytest.mark.slow  # tools that sleep on the wall clock
def test_slow_tool_does_not_block_other_episodes(tok):
    """Episode 'slow' waits 1 s on its first tool call; the others run all their turns
    meanwhile, their next turns submitted the moment their tools answer."""
    release = threading.Event()

    def behaviour(problem, turn):
        if problem.meta.get("slow") and turn.index == 0:
            release.wait(1.0)
        return default_behaviour(problem, turn)

    eng = ScriptedEngine(say_go(tok), delay=0.01)
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour), tool_threads=4)
    problems = [toy_problem(0, turns=3, slow=True)] + [toy_problem(i, turns=3)
                                                        for i in range(1, 4)]
    t0 = time.monotonic()
    order, when = [], {}
    runner.start(problems[0], episode_id="slow")
    for i, p in enumerate(problems[1:], 1):
        runner.start(p, episode_id=f"fast{i}")
    while len(order) < 4:
        for e in runner.poll(timeout=0.02):
            order.append(e.episode_id)
            when[e.episode_id] = time.monotonic() - t0
    assert order[-1] == "slow" and set(order[:3]) == {"fast1", "fast2", "fast3"}
    assert max(when[f"fast{i}"] for i in (1, 2, 3)) < 0.8 < when["slow"]
    # the fast episodes' later turns reached the engine while the slow tool was running
    first_slow_t1 = [r.request_id for r in eng.submitted].index("slow/t1")
    assert {f"fast{i}/t2" for i in (1, 2, 3)} <= {r.request_id
                                                  for r in eng.submitted[:first_slow_t1]}


@pytest.mark.slow  # tools that sleep on the wall clock
def test_many_slow_tools_overlap(tok):
    def behaviour(problem, turn):
        time.sleep(0.2)
        return default_behaviour(problem, turn)

    eng = ScriptedEngine(say_go(tok), delay=0.005)
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour), tool_threads=8)
    t0 = time.monotonic()
    eps = runner.run([toy_problem(i, turns=3) for i in range(8)])
    took = time.monotonic() - t0
    assert all(e.status == "done" for e in eps)
    assert took < 2.0, took  # 24 tool calls of 0.2 s one after another would take 4.8 s
    assert runner.stats()["tool_time_s"] >= 24 * 0.2


def test_rollout_fields_pass_the_queue_checks(tok):
    eng = ScriptedEngine(say_go(tok))
    runner = EpisodeRunner(eng, tok, ToyTask())
    ep, = runner.run([toy_problem(0, turns=3)])
    fields = ep.rollout_fields(advantage=0.7, group_size=4)
    mask, turn_index = fields.pop("loss_mask"), fields.pop("turn_index")
    assert mask.dtype == np.uint8 and mask.shape == turn_index.shape == ep.completion_ids.shape
    r = records.Rollout(**fields)
    assert r.finish_reason == "stop" and r.metrics["turns"] == 3.0
    info = codec.validate_rollout(codec.rollout_to_pb(r), codec.Limits(vocab_size=tok.vocab_size),
                                  max_version=0)
    assert info is not None


def test_stop_ids_come_from_the_task(tok):
    assert ToyTask().stop_token_ids(tok) == (tok.eos_id, tok.encode(";")[0])

    class Bad(ToyTask):
        turn_stop_texts = ("ab",)
    with pytest.raises(ValueError, match="one"):
        Bad().stop_token_ids(tok)
    assert EnvReply.finish(1.0, True, why="x").info == {"why": "x"}
