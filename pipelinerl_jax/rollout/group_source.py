"""Group sources: where a rollout worker's groups are sampled. One interface, two kinds.

A source starts a booked group (`start(ticket)`: an `admission.Ticket` with the problem, the
group id and its seed), hands what it started to the engine (`submit()`: one batch per round,
so a lock-step wave reaches the engine whole), and returns the groups that ended
(`poll(timeout)`) as `FinishedGroup`s: the group's members in sample order, or a failure and
none. A member is what the scorer needs of one sample: its reward (`judge`), its length and
whether it was truncated, its `Rollout` fields and its line of `samples.w<i>.jsonl`.

- `SampleGroups` (single-turn): a group is one engine request for `n = group_size` samples of
  one prompt; completions are collected per request id. A request the engine gives up on
  (`RequestError` with its `request_id`, e.g. a malformed SGLang answer) ends its group as
  failed; an error naming no request of ours is raised (a bug, not a fault to ride out).
- `EpisodeGroups` (multi-turn, `pipelinerl_jax.envs`): a group is `group_size` episodes of
  one problem run by a `GroupRunner` over an `EpisodeRunner` (the engine's only completion
  consumer); its members carry their rewards, `loss_mask` and `turn_index`; a group with a
  failed episode comes back failed. The runner's counters are the source's `stats()`.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Optional, Protocol

import numpy as np

from pipelinerl_jax.envs.episode import FINISH_REASON
from pipelinerl_jax.rollout.engine import RequestError
from pipelinerl_jax.records import Completion, GenerationRequest, SamplingParams


class GroupMember(Protocol):
    """One sample of a finished group, as the scorer uses it."""
    length: int  # completion tokens
    truncated: bool

    def judge(self, task, tokenizer, problem): ...  # -> .reward, .correct

    def rollout_fields(self, judged, advantage: float, group_size: int,
                       group_id: str) -> Dict[str, Any]: ...  # `records.Rollout(**fields)`

    def log_record(self, judged) -> dict: ...  # its line of samples.w<i>.jsonl


@dataclasses.dataclass
class FinishedGroup:
    group_id: str
    problem: Any
    members: List[Any]  # GroupMember, in sample order; empty when failed
    failure: Optional[str] = None  # why the group cannot be used; None = complete
    counted_as: Optional[str] = None  # a counter of members scored ('episodes')


class GroupSource(Protocol):
    def start(self, ticket) -> None: ...

    def submit(self) -> None: ...

    def poll(self, timeout: float) -> List[FinishedGroup]: ...

    def stats(self) -> dict: ...  # extra fields of engine_stats.jsonl

    def close(self) -> None: ...


class CompletionMember:
    """One completion of an n-sample request; the task's verifier scores it."""

    def __init__(self, completion: Completion, task_id: str):
        self.completion, self.task_id = completion, task_id
        self.length = len(completion.token_ids)
        self.truncated = completion.finish_reason != "stop"

    def judge(self, task, tokenizer, problem):
        c = self.completion
        return task.reward(problem, tokenizer.decode(c.token_ids, stop_at_eos=True),
                           c.finish_reason)

    def rollout_fields(self, judged, advantage: float, group_size: int,
                       group_id: str) -> Dict[str, Any]:
        c = self.completion
        return dict(
            prompt_ids=c.prompt_ids, completion_ids=c.token_ids,
            logp_behaviour=c.logp_behaviour, version=c.version, kv_version=c.kv_version,
            reward=float(judged.reward), advantage=advantage, group_id=group_id,
            group_size=group_size, task_id=self.task_id, finish_reason=c.finish_reason,
            start_version=c.start_version, engine_id=c.engine_id, submit_time=c.submit_time,
            start_time=c.start_time, finish_time=c.finish_time,
            metrics={"correct": float(judged.correct)})

    def log_record(self, judged) -> dict:
        c = self.completion
        return {"time_s": c.finish_time, "engine_id": c.engine_id,
                "response_length": len(c.token_ids), "reward": judged.reward,
                "correct": judged.correct, "finish_reason": c.finish_reason,
                "start_version": c.start_version, "gen_time_s": c.finish_time - c.start_time,
                "queue_time_s": c.start_time - c.submit_time}


class EpisodeMember:
    """One finished episode; its environment already rewarded it."""

    def __init__(self, episode):
        self.episode = episode
        self.length = len(episode.completion_ids)
        self.truncated = episode.status == "truncated"

    def judge(self, task, tokenizer, problem):
        return self.episode  # .reward, .correct

    def rollout_fields(self, judged, advantage: float, group_size: int,
                       group_id: str) -> Dict[str, Any]:
        e = self.episode
        fields = e.rollout_fields(advantage, group_size, group_id)
        fields["metrics"][f"end/{e.end_reason}"] = 1.0
        return fields

    def log_record(self, judged) -> dict:
        e = self.episode
        return {"time_s": e.finish_time, "engine_id": e.engine_id,
                "response_length": len(e.completion_ids), "model_tokens": e.model_tokens,
                "reward": e.reward, "correct": e.correct,
                "finish_reason": FINISH_REASON[e.status], "status": e.status,
                "end_reason": e.end_reason, "turns": len(e.turns),
                "start_version": e.start_version,
                "turn_versions": [[t.version_min, t.version_max] for t in e.turns],
                "gen_time_s": e.finish_time - e.start_time,
                "tool_time_s": sum(t.tool_latency_s or 0.0 for t in e.turns)}


class SampleGroups:
    """n samples of one prompt per group (module docstring)."""

    def __init__(self, engine, tokenizer, *, task_id: str, group_size: int, sampling: dict):
        self.engine, self.tok, self.task_id = engine, tokenizer, task_id
        self.group_size = group_size
        self.sampling = dict(sampling, n=group_size, stop_token_ids=(tokenizer.eos_id,))
        self._problems: Dict[str, Any] = {}  # request id -> problem, until its group ends
        self._samples: Dict[str, List[Completion]] = collections.defaultdict(list)
        self._requests: List[GenerationRequest] = []  # started, not yet submitted

    def start(self, ticket) -> None:
        self._requests.append(GenerationRequest(
            ticket.group_id, np.asarray(self.tok.encode_prompt(ticket.problem.prompt), np.int32),
            SamplingParams(seed=ticket.seed, **self.sampling)))
        self._problems[ticket.group_id] = ticket.problem

    def submit(self) -> None:
        if self._requests:
            requests, self._requests = self._requests, []
            self.engine.submit_batch(requests)

    def poll(self, timeout: float) -> List[FinishedGroup]:
        try:
            completions = self.engine.get_completions(timeout=timeout)
        except RequestError as e:
            rid = getattr(e, "request_id", None)
            if rid not in self._problems:
                raise  # not one of ours: a bug, not a fault to ride out
            self._samples.pop(rid, None)
            return [FinishedGroup(rid, self._problems.pop(rid), [], failure=str(e))]
        done = []
        for c in completions:
            group = self._samples[c.request_id]
            group.append(c)
            if len(group) == self.group_size:
                samples = sorted(self._samples.pop(c.request_id), key=lambda s: s.sample_index)
                done.append(FinishedGroup(c.request_id, self._problems.pop(c.request_id),
                                          [CompletionMember(s, self.task_id) for s in samples]))
        return done

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass  # the engine belongs to the caller


class EpisodeGroups:
    """A group of episodes of one problem (module docstring)."""

    def __init__(self, groups):
        self.groups = groups  # envs.GroupRunner
        self.runner = groups.runner

    def start(self, ticket) -> None:
        self.groups.start(ticket.problem, group_id=ticket.group_id, seed=ticket.seed)

    def submit(self) -> None:
        pass  # the episode runner submits each turn itself

    def poll(self, timeout: float) -> List[FinishedGroup]:
        return [FinishedGroup(g.group_id, g.problem, [EpisodeMember(e) for e in g.episodes],
                              failure=g.reason, counted_as="episodes")
                for g in self.groups.poll(timeout=timeout)]

    def stats(self) -> dict:
        return {"env": self.runner.stats()}

    def close(self) -> None:
        """Ends the episodes in flight and the tool threads."""
        self.runner.close()
