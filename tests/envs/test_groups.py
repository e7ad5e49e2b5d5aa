"""Groups of episodes: whole or not at all, and dynamic sampling that keeps a batch full."""
import itertools

import pytest

from pipelinerl_jax.envs import (EnvReply, EpisodeRunner, GroupResult, GroupRunner,
                                 GroupSampler, drop_reason, run_group)
from tests.envs.conftest import ToyTask, default_behaviour, toy_problem
from tests.envs.scripted_engine import ScriptedEngine


def by_episode_index(tok):
    """Episode i of a group says 'e<i>;' (its request id tells the policy which it is)."""
    def policy(req, i):
        index = req.request_id.split("/")[-2]  # '<group>/e<i>/t<k>'
        return tok.encode(f"{index};")
    return policy


def test_complete_group_has_every_episode_in_order_with_distinct_seeds(tok):
    eng = ScriptedEngine(by_episode_index(tok), delay=lambda r: 0.001 * (5 - int(
        r.request_id.split("/e")[1][0])))  # later episodes finish first
    g = run_group(EpisodeRunner(eng, tok, ToyTask()), toy_problem(0, turns=2), 4, seed=7)
    assert g.ok and [e.index for e in g.episodes] == [0, 1, 2, 3]
    assert {e.group_id for e in g.episodes} == {g.group_id}
    assert [tok.decode(e.completion_ids) for e in g.episodes] == [
        f"e{i};=0\ne{i};" for i in range(4)]
    seeds = {r.request_id: r.params.seed for r in eng.submitted}
    assert len(set(seeds.values())) == len(seeds) == 8  # per episode and per turn
    again = ScriptedEngine(by_episode_index(tok))
    run_group(EpisodeRunner(again, tok, ToyTask()), toy_problem(0, turns=2), 4, seed=7)
    assert {r.request_id: r.params.seed for r in again.submitted} == seeds  # reproducible


def test_one_failed_episode_drops_the_group_and_cancels_the_rest(tok):
    def behaviour(problem, turn):
        if turn.text == "e2;":
            raise RuntimeError("tool down")
        return default_behaviour(problem, turn)

    # the other episodes' second turns never finish on their own
    eng = ScriptedEngine(by_episode_index(tok), delay=lambda r: 3600 if r.request_id.endswith(
        "/t1") else 0.001)
    runner = EpisodeRunner(eng, tok, ToyTask(behaviour))
    groups = GroupRunner(runner, group_size=4)
    gid = groups.start(toy_problem(0, turns=3), seed=1)
    got = []
    while not got:
        got = groups.poll(timeout=0.05)
    g, = got
    assert g.group_id == gid and not g.ok and g.episodes == []
    assert g.reason.startswith("episode 2: tool_error") and "tool down" in g.reason
    assert sorted(eng.aborted) == [f"{gid}/e{i}/t1" for i in (0, 1, 3)]
    assert runner.active == 0 and groups.active == 0
    assert groups.counts["groups_failed"] == 1 and groups.counts["groups_failed.tool_error"] == 1
    assert runner.stats()["episodes_cancelled"] == 3
    assert groups.poll(timeout=0.05) == []  # nothing of that group comes back later


def test_truncated_episodes_are_ordinary_members(tok):
    eng = ScriptedEngine(by_episode_index(tok))
    runner = EpisodeRunner(eng, tok, ToyTask(), max_turns=2)
    g = run_group(runner, toy_problem(0, turns=5), 3)
    assert g.ok and {e.end_reason for e in g.episodes} == {"max_turns"}
    assert drop_reason(g, True) == "equal_rewards" and drop_reason(g, False) is None


def test_run_group_timeout_cancels_everything(tok):
    eng = ScriptedEngine(by_episode_index(tok), delay=3600)
    runner = EpisodeRunner(eng, tok, ToyTask())
    g = run_group(runner, toy_problem(0), 2, timeout=0.1)
    assert not g.ok and "timeout" in g.reason and runner.active == 0
    assert len(eng.aborted) == 2


def sampler_setup(tok, problems, **kw):
    """Episode e0 gets reward 1; the others get the problem's `other` reward, so a problem
    with other=1 makes an all-equal group. A problem with `broken` makes its tool raise."""
    def behaviour(problem, turn):
        if problem.meta.get("broken"):
            raise RuntimeError("broken tool")
        return EnvReply.finish(1.0 if turn.text == "e0;" else problem.meta["other"])

    eng = ScriptedEngine(by_episode_index(tok), delay=0.001)
    groups = GroupRunner(EpisodeRunner(eng, tok, ToyTask(behaviour)), group_size=3)
    return GroupSampler(groups, iter(problems), **kw)


def test_dynamic_sampling_drops_all_equal_groups_and_keeps_the_batch_full(tok):
    problems = [toy_problem(i, other=float(i % 2 == 0), broken=i == 3) for i in range(40)]
    sampler = sampler_setup(tok, problems, max_groups_in_flight=1)
    batch = sampler.sample(num_groups=4)
    # problems 0, 2, 4, ... are all-equal; 3 is broken; 1, 5, 7, 9 are kept
    assert [g.problem.id for g in batch] == ["toy/i1", "toy/i5", "toy/i7", "toy/i9"]
    assert all(g.ok and not g.all_equal and len(g.episodes) == 3 for g in batch)
    c = sampler.counts
    assert (c["groups_kept"], c["groups_dropped_equal_rewards"], c["groups_dropped_failed"],
            c["replacements"]) == (4, 5, 1, 6)
    nxt = sampler.sample(num_groups=2)  # the stream goes on where it stopped
    assert [g.problem.id for g in nxt] == ["toy/i11", "toy/i13"]
    assert sampler.counts["replacements"] == 6 + 2 and sampler.counts["batches"] == 2


def test_without_dynamic_sampling_equal_groups_are_kept(tok):
    problems = [toy_problem(i, other=1.0) for i in range(10)]
    sampler = sampler_setup(tok, problems, drop_equal_rewards=False, max_groups_in_flight=3)
    batch = sampler.sample(num_groups=5)
    assert len(batch) == 5 and all(g.all_equal for g in batch)
    assert sampler.counts["replacements"] == 0


def test_many_groups_in_flight(tok):
    problems = itertools.cycle([toy_problem(0, other=0.0)])
    sampler = sampler_setup(tok, problems, max_groups_in_flight=6)
    batch = sampler.sample(num_groups=12, timeout=30)
    assert len(batch) == 12 and len({g.group_id for g in batch}) == 12
    with pytest.raises(TimeoutError):  # only all-equal groups: never full
        sampler_setup(tok, itertools.repeat(toy_problem(1, other=1.0))).sample(2, timeout=0.3)
    with pytest.raises(RuntimeError, match="stream ended"):
        sampler_setup(tok, iter([toy_problem(1, other=1.0)] * 3)).sample(2)


def test_group_result_properties():
    empty = GroupResult("g", toy_problem(0), [], reason="x")
    assert not empty.ok and not empty.all_equal and drop_reason(empty, False) == "failed"
