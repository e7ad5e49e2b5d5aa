"""`EpisodeRunner`: drives many multi-turn episodes through one `InferenceEngine` at once.

Token-in/token-out. Each turn is one engine request (n=1) whose prompt is the episode's exact
ids so far; the engine's ids, log-probs and versions are copied as they came; an environment's
reply is appended as ids (`envs.base`). The result is one `Episode` (`envs.episode`): one token
sequence with a loss mask and per-token provenance. An episode spanning weight updates
carries, per turn, exactly the versions the engine reported.

Concurrency. `poll()` is called from one thread (the worker's loop). Environment steps run on
a `ToolPool`; the moment a step answers, the episode's next turn is submitted, so while one
episode waits on a slow tool the engine's slots serve the other episodes' turns. The runner
must be the only consumer of `engine.get_completions()` (completions of unknown requests are
dropped and counted as `stray_completions`).

How an episode ends (`status` / `end_reason`):
  done       env said done: its reward.
  truncated  a limit ended it: `max_turns` (the last turn was answered but no turn is left),
             `max_tokens` (no room left in `max_episode_tokens`, which the engine's
             `max_seq_len` bounds), `turn_length` (a turn hit `max_turn_tokens` without a stop
             token). Reward: the task's `truncated_reward`. A normal, trainable outcome.
  failed     not the policy's doing, never trained (a group containing one is dropped):
             `tool_error` (step raised), `tool_timeout` (step ran longer than
             `tool_timeout_s`; a call waiting for a free tool thread is not timed out unless
             the pool has no live thread left), `env_garbage` (a reply that is not an
             `EnvReply`, non-str text, text that does not encode, ids outside the vocabulary,
             over `max_env_tokens`, a non-finite reward), `make_env_error`, `bad_prompt`
             (does not encode), `prompt_too_long` (no room for a model token),
             `request_error` (the engine refused or gave up on a turn), `aborted` (a turn came
             back aborted), `bad_completion` (per-token arrays of unequal lengths).
Every end reason is counted in `stats()`; nothing an environment does stops the runner.
`EngineClosedError` from the engine propagates: the engine itself is gone.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from pipelinerl_jax.envs.base import EnvTask
from pipelinerl_jax.envs.episode import Episode, TurnRecord
from pipelinerl_jax.envs.tools import EnvGarbage, StepRaised, ToolPool, run_step
from pipelinerl_jax.rollout.engine import RequestError
from pipelinerl_jax.tasks.base import Problem
from pipelinerl_jax.records import GenerationRequest, SamplingParams


class _Live:
    """Runner-side state of an episode in progress."""

    def __init__(self, eid, problem, env, prompt, seed, group_id, index):
        self.id, self.problem, self.env, self.seed = eid, problem, env, seed
        self.group_id, self.index = group_id, index
        self.prompt = prompt
        self.ids: list = [prompt]  # sequence so far, in chunks
        self.length = len(prompt)
        self.parts: list = []  # (ids, mask, logp, version, kv_version, turn) per chunk
        self.turns: List[TurnRecord] = []
        self.request_id: Optional[str] = None
        self.future = None
        self.tool_start = 0.0  # when the step was handed to the pool
        self.start_time = time.time()


class EpisodeRunner:
    """Runs episodes of `task` (an `EnvTask`) on `engine` (module docstring).

    Limits: `max_turns` model turns (default: the task's `default_max_turns`); `max_turn_tokens`
    new tokens per turn; `max_episode_tokens` for the whole sequence (default and cap: the
    engine's `max_seq_len`); `max_env_tokens` per reply; `tool_timeout_s` per step.
    Sampling: `temperature`, `top_p`, `top_k`; stop ids default to `task.stop_token_ids`.
    """

    def __init__(self, engine, tokenizer, task: EnvTask, *, max_turns: Optional[int] = None,
                 max_turn_tokens: int = 64, max_episode_tokens: Optional[int] = None,
                 max_env_tokens: int = 128, tool_timeout_s: float = 10.0,
                 tool_threads: int = 16, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, stop_token_ids: Optional[Sequence[int]] = None,
                 tick_s: float = 0.005):
        self.engine, self.tok, self.task = engine, tokenizer, task
        self.max_turns = int(max_turns or task.default_max_turns)
        self.max_turn_tokens = int(max_turn_tokens)
        limits = [x for x in (max_episode_tokens, getattr(engine, "max_seq_len", None)) if x]
        self.max_episode_tokens = int(min(limits)) if limits else 1 << 30
        self.max_env_tokens, self.tool_timeout_s = int(max_env_tokens), float(tool_timeout_s)
        self.stop_ids = tuple(int(i) for i in (stop_token_ids if stop_token_ids is not None
                                               else task.stop_token_ids(tokenizer)))
        self._stop_text = {i: task.stop_text_of(tokenizer, i) for i in self.stop_ids}
        self._sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                              stop_token_ids=self.stop_ids, n=1)
        self.tick_s = tick_s
        self.pool = ToolPool(tool_threads, name=f"{task.name}-tool")
        self._live: Dict[str, _Live] = {}
        self._by_request: Dict[str, _Live] = {}
        self._orphans: list = []  # (future, hand-off time) of steps whose episode ended
        self._finished: List[Episode] = []
        self._seq = 0
        self.counts: collections.Counter = collections.Counter()
        self._tool_time_max = 0.0

    # ------------------------------------------------------------------ public

    @property
    def active(self) -> int:
        return len(self._live)

    def start(self, problem: Problem, *, episode_id: Optional[str] = None,
              seed: Optional[int] = None, group_id: str = "", index: int = 0) -> str:
        """Starts an episode (its first turn is submitted now); returns its id."""
        eid = episode_id or f"ep{self._seq}"
        self._seq += 1
        if eid in self._live:
            raise ValueError(f"episode id {eid!r} is already running")
        self.counts["episodes_started"] += 1
        try:
            prompt, error = np.asarray(self.tok.encode_prompt(problem.prompt), np.int32), None
        except Exception as e:  # noqa: BLE001 - a task item the tokenizer cannot encode
            prompt, error = np.zeros((0,), np.int32), str(e)[:300]
        ep = self._live[eid] = _Live(eid, problem, None, prompt, seed, group_id, index)
        if error is not None:
            self._end(ep, "failed", "bad_prompt", detail=error)
            return eid
        if len(prompt) >= self.max_episode_tokens:
            self._end(ep, "failed", "prompt_too_long", detail=f"{len(prompt)} prompt tokens, "
                      f"max_episode_tokens={self.max_episode_tokens}")
            return eid
        try:
            ep.env = self.task.make_env(problem)
        except Exception as e:  # noqa: BLE001 - a broken environment ends its episode only
            self._end(ep, "failed", "make_env_error", detail=f"{type(e).__name__}: {e}"[:300])
            return eid
        self._submit_turn(ep)
        return eid

    def cancel(self, episode_id: str) -> bool:
        """Ends an episode without a result (its in-flight turn is aborted); True if it ran."""
        ep = self._live.pop(episode_id, None)
        if ep is None:
            return False
        self._finished = [e for e in self._finished if e.episode_id != episode_id]
        if ep.request_id is not None:
            self._by_request.pop(ep.request_id, None)
            try:
                self.engine.abort(ep.request_id)
            except Exception:  # noqa: BLE001 - best effort: its completion is dropped anyway
                pass
        if ep.future is not None:
            self._orphans.append((ep.future, ep.tool_start))
        self.counts["episodes_cancelled"] += 1
        return True

    def poll(self, timeout: float = 0.0) -> List[Episode]:
        """Advances every episode; returns those that finished (waits up to `timeout` s for
        at least one)."""
        deadline = time.monotonic() + timeout
        while True:
            moved = self._collect_steps()
            left = deadline - time.monotonic()
            try:
                comps = self.engine.get_completions(
                    timeout=0.0 if moved or self._finished else max(0.0, min(self.tick_s, left)))
            except RequestError as e:
                comps = []
                ep = self._by_request.pop(getattr(e, "request_id", None) or "", None)
                if ep is None:
                    raise
                ep.request_id = None
                self._end(ep, "failed", "request_error", detail=str(e)[:300])
            for c in comps:
                self._on_completion(c)
            self._expire()
            if self._finished or time.monotonic() >= deadline:
                out, self._finished = self._finished, []
                return out

    def run(self, problems: Iterable[Problem], seeds: Optional[Sequence[int]] = None,
            timeout: Optional[float] = None) -> List[Episode]:
        """Runs one episode per problem concurrently; returns them in the order given."""
        ids = [self.start(p, seed=None if seeds is None else seeds[i])
               for i, p in enumerate(problems)]
        want, got = set(ids), {}
        t_end = None if timeout is None else time.monotonic() + timeout
        while len(got) < len(ids):
            if t_end is not None and time.monotonic() > t_end:
                for eid in want - set(got):
                    self.cancel(eid)
                raise TimeoutError(f"{len(ids) - len(got)} episodes unfinished after {timeout}s")
            for e in self.poll(timeout=0.05):
                if e.episode_id in want:
                    got[e.episode_id] = e
        return [got[i] for i in ids]

    def stats(self) -> Dict[str, Any]:
        waiting = sum(1 for e in self._live.values() if e.future is not None)
        return {**self.counts, "active_episodes": len(self._live), "waiting_on_tools": waiting,
                "generating": len(self._by_request), "tool_threads_stuck": self.pool.stuck,
                "tool_time_max_s": self._tool_time_max}

    def close(self) -> None:
        for eid in list(self._live):
            self.cancel(eid)
        self.pool.close()

    # ------------------------------------------------------------------ turns

    def _submit_turn(self, ep: _Live) -> None:
        budget = self.max_episode_tokens - ep.length
        if budget <= 0:
            self._end(ep, "truncated", "max_tokens")
            return
        k = len(ep.turns)
        rid = f"{ep.id}/t{k}"
        seed = None if ep.seed is None else int(
            np.random.SeedSequence([int(ep.seed), k]).generate_state(1)[0] % 2**31)
        req = GenerationRequest(rid, np.concatenate(ep.ids).astype(np.int32), SamplingParams(
            max_new_tokens=min(self.max_turn_tokens, budget), seed=seed, **self._sampling))
        try:
            self.engine.submit(req)
        except RequestError as e:
            self._end(ep, "failed", "request_error", detail=str(e)[:300])
            return
        ep.request_id = rid
        self._by_request[rid] = ep

    def _on_completion(self, c) -> None:
        ep = self._by_request.pop(c.request_id, None)
        if ep is None:
            self.counts["stray_completions"] += 1
            return
        ep.request_id = None
        toks = np.asarray(c.token_ids, np.int32)
        arrays = [np.asarray(c.logp_behaviour, np.float32), np.asarray(c.version, np.int32),
                  np.asarray(c.kv_version, np.int32)]
        k = len(ep.turns)
        rec = TurnRecord(index=k, request_id=c.request_id, start=ep.length - len(ep.prompt),
                         model_tokens=len(toks), finish_reason=c.finish_reason,
                         start_version=int(c.start_version), submit_time=c.submit_time,
                         start_time=c.start_time, finish_time=c.finish_time)
        if any(a.shape != toks.shape for a in arrays) or toks.ndim != 1:
            rec.outcome = "bad_completion"
            ep.turns.append(rec)
            self._end(ep, "failed", "bad_completion",
                      detail=f"arrays of lengths {[a.size for a in [toks, *arrays]]}")
            return
        if toks.size:
            rec.version_min, rec.version_max = int(arrays[1].min()), int(arrays[1].max())
            rec.kv_version_min = int(arrays[2].min())
        ep.turns.append(rec)
        self._append(ep, toks, 1, *arrays)
        self.counts["turns"] += 1
        self.counts["model_tokens"] += int(toks.size)
        if c.finish_reason == "abort" or c.finish_reason not in ("stop", "length"):
            rec.outcome = "aborted"
            self._end(ep, "failed", "aborted", detail=f"finish_reason {c.finish_reason!r}")
        elif c.finish_reason == "length" or not toks.size or int(toks[-1]) not in self.stop_ids:
            rec.outcome = reason = ("max_tokens" if ep.length >= self.max_episode_tokens
                                    else "turn_length")
            self._end(ep, "truncated", reason)
        else:
            ep.tool_start = time.monotonic()
            ep.future = self.pool.submit(run_step, ep.env, toks.copy(), k, self._stop_text.get(
                int(toks[-1]), ""), self.tok.eos_id, self.tok, self.max_env_tokens)
            self.counts["tool_calls"] += 1

    def _collect_steps(self) -> bool:
        moved = False
        for ep in [e for e in self._live.values() if e.future is not None and e.future.done()]:
            fut, ep.future = ep.future, None
            rec = ep.turns[-1]
            rec.tool_latency_s = time.monotonic() - ep.tool_start
            self.counts["tool_time_s"] += rec.tool_latency_s
            self._tool_time_max = max(self._tool_time_max, rec.tool_latency_s)
            moved = True
            try:
                res = fut.result()
            except StepRaised as e:
                rec.outcome = "tool_error"
                self._end(ep, "failed", "tool_error", detail=str(e))
                continue
            except EnvGarbage as e:
                rec.outcome = "env_garbage"
                self._end(ep, "failed", "env_garbage", detail=str(e))
                continue
            except BaseException as e:  # noqa: BLE001 - SystemExit etc. raised by a tool
                rec.outcome = "tool_error"
                self._end(ep, "failed", "tool_error", detail=f"{type(e).__name__}: {e}"[:300])
                continue
            if res.done:
                rec.outcome = "done"
                self._end(ep, "done", "done", reward=res.reward, correct=res.correct,
                          info=res.info)
            elif len(ep.turns) >= self.max_turns:
                rec.outcome = "max_turns"
                self._end(ep, "truncated", "max_turns")
            elif ep.length + len(res.ids) >= self.max_episode_tokens:
                rec.outcome = "max_tokens"
                self._end(ep, "truncated", "max_tokens")
            else:
                rec.outcome, rec.env_tokens = "say", len(res.ids)
                last = ep.parts[-1]
                n = len(res.ids)
                self._append(ep, res.ids, 0, np.zeros(n, np.float32),
                             np.full(n, last[3][-1] if len(last[3]) else 0, np.int32),
                             np.full(n, last[4][-1] if len(last[4]) else 0, np.int32))
                self.counts["env_tokens"] += n
                self._submit_turn(ep)
        return moved

    def _overdue(self, fut, handed_at: float, now: float) -> bool:
        if fut.done():  # answered: collected by the next _collect_steps
            return False
        started = self.pool.started(fut)
        if started is None:  # queued: waiting for a free thread is no overrun
            if self.pool.live_threads > 0:
                return False
            started = handed_at  # no thread will ever take it
        return now - started > self.tool_timeout_s

    def _expire(self) -> None:
        now = time.monotonic()
        for ep in [e for e in self._live.values() if e.future is not None]:
            if not self._overdue(ep.future, ep.tool_start, now):
                continue
            fut, ep.future = ep.future, None
            if self.pool.abandon(fut):
                self.counts["tool_threads_abandoned"] += 1
            ep.turns[-1].outcome = "tool_timeout"
            self._end(ep, "failed", "tool_timeout",
                      detail=f"step still running after {self.tool_timeout_s}s")
        keep = []
        for fut, handed_at in self._orphans:
            if fut.done():
                continue
            if self._overdue(fut, handed_at, now):
                if self.pool.abandon(fut):
                    self.counts["tool_threads_abandoned"] += 1
                continue
            keep.append((fut, handed_at))
        self._orphans = keep

    def _append(self, ep: _Live, ids, mask, logp, version, kv_version) -> None:
        ep.ids.append(ids)
        ep.length += len(ids)
        ep.parts.append((ids, np.full(len(ids), mask, np.uint8), logp, version, kv_version,
                         np.full(len(ids), len(ep.turns) - 1, np.int32)))

    def _end(self, ep: _Live, status: str, reason: str, *, reward: Optional[float] = None,
             correct: bool = False, detail: str = "", info: Optional[dict] = None) -> None:
        self._live.pop(ep.id, None)
        if reward is None:
            reward = float(self.task.truncated_reward) if status == "truncated" else 0.0

        def cat(i, dtype):
            return (np.concatenate([p[i] for p in ep.parts]).astype(dtype) if ep.parts
                    else np.zeros((0,), dtype))
        self._finished.append(Episode(
            episode_id=ep.id, problem=ep.problem, group_id=ep.group_id, index=ep.index,
            prompt_ids=ep.prompt, completion_ids=cat(0, np.int32), loss_mask=cat(1, np.uint8),
            logp_behaviour=cat(2, np.float32), version=cat(3, np.int32),
            kv_version=cat(4, np.int32), turn_index=cat(5, np.int32), turns=ep.turns,
            status=status, end_reason=reason, reward=float(reward), correct=bool(correct),
            detail=detail, info=dict(info or {}), task_id=self.task.name,
            engine_id=getattr(self.engine, "engine_id", ""),
            start_time=ep.start_time, finish_time=time.time()))
        self.counts["episodes_finished"] += 1
        self.counts[f"status.{status}"] += 1
        self.counts[f"end.{reason}"] += 1
