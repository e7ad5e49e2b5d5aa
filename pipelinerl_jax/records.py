"""Plain records that cross module and process boundaries: engine requests/completions and rollouts.

Arrays are NumPy (host) arrays: these objects travel between processes, never device
buffers. Per-token provenance follows DESIGN.md ("Provenance"):
  logp_behaviour[t]  log-prob of token t under the distribution it was sampled from,
  version[t]         weight version of the forward pass that sampled token t,
  kv_version[t]      oldest weight version among the KV entries that forward attended to.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one generation request (the SGLang names where they exist)."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    stop_token_ids: Sequence[int] = ()
    n: int = 1  # samples per prompt
    seed: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: np.ndarray  # int32 [P]
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass
class Completion:
    """One finished sample of a request, as an engine returns it."""
    request_id: str
    sample_index: int  # 0..n-1 within the request
    prompt_ids: np.ndarray  # int32 [P]
    token_ids: np.ndarray  # int32 [C]
    logp_behaviour: np.ndarray  # float32 [C]
    version: np.ndarray  # int32 [C]
    kv_version: np.ndarray  # int32 [C]
    finish_reason: str  # one of FINISH_REASONS
    start_version: int  # policy version when generation of this sample started
    engine_id: str = ""
    submit_time: float = 0.0  # time.time() when the request was submitted
    start_time: float = 0.0  # when the sample was admitted into a batch slot (prefill)
    finish_time: float = 0.0  # when the last token was produced


@dataclasses.dataclass
class Rollout:
    """A scored sample as it travels to the learner (one row of a training batch).

    `group_id` ties the `group_size` samples of one prompt together: the queue only ever
    delivers whole groups, so group-normalised advantages stay valid.

    A multi-turn episode (`pipelinerl_jax.envs`) is one rollout whose completion interleaves
    model turns and environment replies: `loss_mask` is 1 on model tokens and 0 on env tokens
    (None = all ones: a single-turn completion) and `turn_index` the turn each token belongs
    to (None for a single turn). Provenance on env tokens is neutral (see `envs.episode`).
    """
    prompt_ids: np.ndarray  # int32 [P]
    completion_ids: np.ndarray  # int32 [C]
    logp_behaviour: np.ndarray  # float32 [C]
    version: np.ndarray  # int32 [C]
    kv_version: np.ndarray  # int32 [C]
    reward: float
    advantage: float
    group_id: str
    group_size: int
    task_id: str = ""
    finish_reason: str = "stop"
    start_version: int = 0
    engine_id: str = ""
    submit_time: float = 0.0
    start_time: float = 0.0
    finish_time: float = 0.0
    metrics: dict = dataclasses.field(default_factory=dict)  # str -> float, e.g. {"correct": 1.0}
    loss_mask: Optional[np.ndarray] = None  # uint8 [C] in {0, 1}, at least one 1; None = all 1
    turn_index: Optional[np.ndarray] = None  # int32 [C] >= 0, non-decreasing; None = one turn
