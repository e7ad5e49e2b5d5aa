"""What an episode run produces: one token sequence with a loss mask, and per-turn records.

`Episode.completion_ids` is everything after the prompt (model turns and env replies, in
order); `loss_mask` is 1 on model tokens and 0 on env tokens; `logp_behaviour`, `version`,
`kv_version` are the engine's values on model tokens and neutral on env tokens (0, and the
previous model token's versions, so every array passes the queue's checks); `turn_index`
gives each token's turn (an env reply belongs to the turn it answers). `rollout_fields`
gives the `records.Rollout` fields plus `loss_mask` / `turn_index`, the two arrays a
multi-segment rollout adds to the wire.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import numpy as np

from pipelinerl_jax.tasks.base import Problem

STATUSES = ("done", "truncated", "failed")
FINISH_REASON = {"done": "stop", "truncated": "length", "failed": "abort"}  # wire names


@dataclasses.dataclass
class TurnRecord:
    """One model turn and the environment's answer to it."""
    index: int
    request_id: str
    start: int  # offset of the turn's first model token in the completion
    model_tokens: int
    env_tokens: int = 0  # ids appended after it (0 when none were)
    finish_reason: str = ""  # the engine's: stop | length | abort
    start_version: int = -1  # engine version when the turn's sample was admitted
    version_min: int = -1
    version_max: int = -1
    kv_version_min: int = -1
    submit_time: float = 0.0
    start_time: float = 0.0
    finish_time: float = 0.0
    tool_latency_s: Optional[float] = None  # hand-off to answer (None: no step / no answer)
    outcome: str = ""  # 'say' | 'done' | an end reason


@dataclasses.dataclass
class Episode:
    """A finished episode: one token sequence plus what each turn was (module docstring)."""
    episode_id: str
    problem: Problem
    group_id: str
    index: int  # position within its group
    prompt_ids: np.ndarray  # int32 [P]
    completion_ids: np.ndarray  # int32 [C]
    loss_mask: np.ndarray  # uint8 [C]: 1 model token, 0 env token
    logp_behaviour: np.ndarray  # float32 [C]
    version: np.ndarray  # int32 [C]
    kv_version: np.ndarray  # int32 [C]
    turn_index: np.ndarray  # int32 [C]
    turns: List[TurnRecord]
    status: str
    end_reason: str
    reward: float = 0.0
    correct: bool = False
    detail: str = ""
    info: dict = dataclasses.field(default_factory=dict)
    task_id: str = ""
    engine_id: str = ""
    start_time: float = 0.0
    finish_time: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    @property
    def model_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def start_version(self) -> int:
        return self.turns[0].start_version if self.turns else 0

    def rollout_fields(self, advantage: float, group_size: int,
                       group_id: Optional[str] = None) -> Dict[str, Any]:
        """The `records.Rollout` fields of this episode plus `loss_mask` and `turn_index`
        (what a multi-segment rollout adds to the wire). `group_id` defaults to the group the
        episode ran in, else its own id."""
        return dict(
            prompt_ids=self.prompt_ids, completion_ids=self.completion_ids,
            logp_behaviour=self.logp_behaviour, version=self.version,
            kv_version=self.kv_version, reward=float(self.reward), advantage=float(advantage),
            group_id=group_id or self.group_id or self.episode_id, group_size=int(group_size),
            task_id=self.task_id,
            finish_reason=FINISH_REASON[self.status], start_version=max(self.start_version, 0),
            engine_id=self.engine_id,
            submit_time=self.turns[0].submit_time if self.turns else 0.0,
            start_time=self.start_time, finish_time=self.finish_time,
            metrics={"correct": float(self.correct), "turns": float(len(self.turns)),
                     "env_tokens": float(len(self.loss_mask) - self.model_tokens),
                     "tool_time_s": float(sum(t.tool_latency_s or 0.0 for t in self.turns))},
            loss_mask=self.loss_mask, turn_index=self.turn_index)
