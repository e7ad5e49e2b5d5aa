"""Hostile environments: a step that raises, hangs past its timeout, or returns garbage ends
its own episode with a recorded reason, counted; the runner and the other episodes go on."""
import threading
import pytest

from pipelinerl_jax.envs import EnvReply, EpisodeRunner
from pipelinerl_jax.envs.tools import ToolPool
from tests.envs.conftest import ToyTask, default_behaviour, say_go, toy_problem
from tests.envs.scripted_engine import ScriptedEngine

FOREVER = threading.Event()  # set only when the module's tests are over


@pytest.fixture(scope="module", autouse=True)
def free_hung_threads():
    yield
    FOREVER.set()


def hostile(kind):
    """A behaviour that is fine for 'good' problems and does `kind` on the second turn."""
    def behaviour(problem, turn):
        if not problem.meta.get("evil") or turn.index == 0:
            return default_behaviour(problem, turn)
        return ATTACKS[kind]()
    return behaviour


def _raise():
    raise RuntimeError("tool crashed")


def _exit():
    raise SystemExit(3)


def _hang():
    FOREVER.wait()


ATTACKS = {
    "raises": _raise,
    "system_exit": _exit,
    "hangs": _hang,
    "returns_none": lambda: None,
    "returns_str": lambda: "=42\n",
    "text_not_str": lambda: EnvReply(text=b"=42"),
    "text_and_ids": lambda: EnvReply(text="=1", token_ids=[3]),
    "absurdly_long_text": lambda: EnvReply.say("=" + "9" * 10_000_000),
    "too_many_tokens": lambda: EnvReply.say("9" * 200),
    "unencodable_text": lambda: EnvReply.say("<result>42</result>"),
    "negative_id": lambda: EnvReply.say_ids([5, -1]),
    "id_past_vocab": lambda: EnvReply.say_ids([5, 10**9]),
    "float_ids": lambda: EnvReply.say_ids([1.5, 2.0]),
    "string_ids": lambda: EnvReply.say_ids("abc"),
    "nested_ids": lambda: EnvReply.say_ids([[5, 6]]),
    "ragged_ids": lambda: EnvReply.say_ids([[5], [6, 7]]),
    "nan_reward": lambda: EnvReply.finish(float("nan")),
    "huge_reward": lambda: EnvReply.finish(1e300),
    "str_reward": lambda: EnvReply.finish("1.0"),
}
REASON = {"raises": "tool_error", "system_exit": "tool_error", "hangs": "tool_timeout"}


@pytest.mark.parametrize("kind", sorted(ATTACKS))
def test_hostile_step_ends_only_its_episode(kind, tok):
    eng = ScriptedEngine(say_go(tok), delay=0.002)
    runner = EpisodeRunner(eng, tok, ToyTask(hostile(kind)), tool_timeout_s=0.3,
                           max_env_tokens=64, tool_threads=2)
    problems = [toy_problem(0, turns=3, evil=True)] + [toy_problem(i, turns=3)
                                                       for i in range(1, 4)]
    eps = runner.run(problems, timeout=20)
    evil, good = eps[0], eps[1:]
    reason = REASON.get(kind, "env_garbage")
    assert (evil.status, evil.end_reason) == ("failed", reason), evil.detail
    assert evil.detail and evil.turns[-1].outcome == reason and len(evil.turns) == 2
    assert all(e.status == "done" and len(e.turns) == 3 for e in good)
    s = runner.stats()
    assert s[f"end.{reason}"] == 1 and s["end.done"] == 3 and s["status.failed"] == 1
    if kind == "hangs":  # cut at its timeout, its thread written off: the run did not wait
        assert s["tool_threads_abandoned"] == 1 and s["tool_threads_stuck"] == 1
    runner.close()


def test_hung_tools_do_not_starve_the_pool(tok):
    """One tool thread; every other episode's tool hangs. Each hang is abandoned at its
    timeout and a replacement thread serves the next call, so all episodes end."""
    def behaviour(problem, turn):
        if problem.meta.get("evil"):
            FOREVER.wait()
        return default_behaviour(problem, turn)

    eng = ScriptedEngine(say_go(tok), delay=0.002)
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour), tool_timeout_s=0.2, tool_threads=1)
    problems = [toy_problem(i, turns=2, evil=i % 2 == 0) for i in range(6)]
    eps = runner.run(problems, timeout=20)
    assert [e.end_reason for e in eps] == ["tool_timeout", "done"] * 3
    s = runner.stats()
    assert s["end.tool_timeout"] == 3 and s["tool_threads_abandoned"] == 3
    runner.close()


def test_a_step_that_scribbles_on_the_turn_ids_changes_nothing(tok):
    def behaviour(problem, turn):
        turn.token_ids[:] = 0
        return default_behaviour(problem, turn)

    eng = ScriptedEngine(say_go(tok))
    ep, = EpisodeRunner(eng, tok, ToyTask(behaviour)).run([toy_problem(0, turns=2)])
    assert ep.status == "done" and tok.decode(ep.completion_ids) == "go;=0\ngo;"


def test_broken_make_env_is_contained(tok):
    class Broken(ToyTask):
        def make_env(self, problem):
            raise KeyError("no sandbox")

    eng = ScriptedEngine(say_go(tok))
    runner = EpisodeRunner(eng, tok, Broken())
    ep, = runner.run([toy_problem(0)])
    assert (ep.status, ep.end_reason) == ("failed", "make_env_error") and "sandbox" in ep.detail
    assert eng.submitted == []


def test_undecodable_model_tokens_reach_the_env_as_text_without_them(tok):
    """An engine vocabulary larger than the tokenizer's: ids the tokenizer cannot decode stay
    in the sequence and are left out of the turn's text only."""
    seen = []

    def behaviour(problem, turn):
        seen.append((turn.text, turn.token_ids.tolist(), turn.stop_text, turn.ended_with_eos))
        return EnvReply.finish(1.0)

    ids = [60, *tok.encode("go"), 63, *tok.encode(";")]
    eng = ScriptedEngine(lambda req, i: ids)
    ep, = EpisodeRunner(eng, tok, ToyTask(behaviour)).run([toy_problem(0)])
    assert ep.status == "done" and ep.completion_ids.tolist() == ids
    assert seen == [("go;", ids, ";", False)]


def _hang_once_started(started: threading.Event):
    started.set()
    FOREVER.wait()


def test_tool_pool_cancels_queued_calls_and_replaces_stuck_threads():
    pool = ToolPool(num_threads=1, max_abandoned=1)
    started = threading.Event()
    stuck = pool.submit(_hang_once_started, started)
    queued = pool.submit(lambda: 1)
    assert started.wait(10)  # the one thread runs `stuck`; `queued` waits behind it
    assert not pool.abandon(queued) and queued.cancelled()  # never started: just cancelled
    assert pool.abandon(stuck) and pool.stuck == 1
    assert pool.submit(lambda: 2).result(timeout=2) == 2  # the replacement thread serves
    started.clear()
    again = pool.submit(_hang_once_started, started)
    assert started.wait(10)
    assert pool.abandon(again) and pool.stuck == 2  # past max_abandoned: no replacement
    assert pool.live_threads == 0
    late = pool.submit(lambda: 3)  # no thread left to run it: it stays pending
    assert not late.running() and not late.done()
    pool.close()
    assert pool.abandoned_total == 2


def test_queued_calls_time_out_only_when_no_thread_is_left(tok):
    """With every thread stuck and none to replace it, a queued call can never run: the
    runner ends its episode at the timeout instead of waiting forever."""
    def behaviour(problem, turn):
        FOREVER.wait()

    eng = ScriptedEngine(say_go(tok))
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour), tool_timeout_s=0.2, tool_threads=1)
    runner.pool.max_abandoned = 0
    eps = runner.run([toy_problem(i) for i in range(3)], timeout=10)
    assert [e.end_reason for e in eps] == ["tool_timeout"] * 3
    assert runner.pool.live_threads == 0
