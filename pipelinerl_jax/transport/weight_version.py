"""The weight message: what one published version carries, said by the version itself.

    kind            'full' (every weight of the model) | 'lora' (only the LoRA adapters)
    version         the stream version (increasing per publisher)
    policy_version  the policy these weights are (lag injection ships an older one as a new
                    stream version; otherwise = version)
    base_sha256     identity of the base model: sha256 of its checkpoint (config + weights,
                    `models.lora.base_identity`); adapters only mean something on that base
    lora            for 'lora': rank, alpha and targets (`models.lora.LoRASpec`)
    tensors | path  the payload: flat host arrays `{name: array}`, or the absolute path of a
                    versioned directory holding them (an HF checkpoint, or for 'lora' a PEFT
                    adapter directory)

The same fields travel in `WeightHeader` (rollout.proto). A *description* is a message without
payload (version -1): what a run publishes, built once by `describe_run` from the run config
(the one place outside config validation and the learner's model construction that reads
`lora.enabled`); every version is `description.carrying(version, tensors=... | path=...)`.
Receivers (engines, the weight subscriber, the evaluator) hold the description of what they
serve and refuse anything else (`refusal`): an unknown kind, another kind than theirs, LoRA
adapters of another base (the message names both hashes) or of another rank/alpha/targets.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import numpy as np

from pipelinerl_jax.models.lora import LoRASpec, base_identity, lora_spec

KINDS = ("full", "lora")
DESCRIPTION_FILE = "weight_version.json"  # beside the weights in a versioned directory


class WeightVersionRefused(ValueError):
    """A version its receiver cannot serve (the message says why)."""


@dataclasses.dataclass(frozen=True)
class WeightVersion:
    kind: str
    base_sha256: str = ""
    lora: Optional[LoRASpec] = None
    version: int = -1
    policy_version: Optional[int] = None  # None: = version
    tensors: Optional[Mapping[str, np.ndarray]] = dataclasses.field(default=None, repr=False)
    path: Optional[str] = None

    def __post_init__(self):
        problem = self.problem()
        if problem is not None:
            raise WeightVersionRefused(problem)

    def problem(self) -> Optional[str]:
        """Why this message is malformed, or None."""
        if self.kind not in KINDS:
            return f"weight version {self.version}: unknown kind {self.kind!r}; known {KINDS}"
        if (self.kind == "lora") != (self.lora is not None):
            return (f"weight version {self.version}: kind {self.kind!r} with "
                    f"lora={self.lora!r} (rank/alpha/targets come with 'lora' only)")
        if self.kind == "lora" and not self.base_sha256:
            return f"weight version {self.version}: LoRA adapters without their base's sha256"
        if self.tensors is not None and self.path is not None:
            return f"weight version {self.version}: both tensors and a path"
        return None

    @property
    def policy(self) -> int:
        """The policy version these weights are."""
        return self.version if self.policy_version is None else int(self.policy_version)

    @property
    def has_payload(self) -> bool:
        return self.tensors is not None or self.path is not None

    def carrying(self, version: int, *, tensors: Optional[Mapping] = None,
                 path: Optional[str] = None,
                 policy_version: Optional[int] = None) -> "WeightVersion":
        """This description with a payload: version `version`."""
        if (tensors is None) == (path is None):
            raise ValueError(f"weight version {version}: give tensors or a path (one)")
        return dataclasses.replace(self, version=int(version), tensors=tensors, path=path,
                                   policy_version=None if policy_version is None
                                   else int(policy_version))

    def description(self) -> "WeightVersion":
        """Kind, base and LoRA shape only (no version, no payload)."""
        return WeightVersion(self.kind, self.base_sha256, self.lora)

    def payload_bytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in (self.tensors or {}).values())

    # ------------------------------------------------------------------ on disk

    def to_json(self) -> dict:
        """Kind, base, LoRA shape and versions (what `DESCRIPTION_FILE` holds)."""
        out = {"kind": self.kind, "base_sha256": self.base_sha256, "version": self.version,
               "policy_version": self.policy}
        if self.lora is not None:
            out["lora"] = {"rank": self.lora.rank, "alpha": self.lora.alpha,
                           "targets": list(self.lora.targets)}
        return out

    @classmethod
    def from_json(cls, d: Mapping, path: Optional[str] = None) -> "WeightVersion":
        lora = d.get("lora")
        return cls(str(d.get("kind")), str(d.get("base_sha256") or ""),
                   None if lora is None else LoRASpec(int(lora["rank"]), float(lora["alpha"]),
                                                      tuple(lora["targets"])),
                   int(d.get("version", -1)), d.get("policy_version"), None, path)


def refusal(serves: WeightVersion, got: WeightVersion) -> Optional[str]:
    """Why a receiver serving `serves` (a description) must refuse `got`, or None."""
    problem = got.problem()
    if problem is not None:
        return problem
    v = got.version
    if got.kind != serves.kind:
        return (f"weight version {v}: kind {got.kind!r}, this receiver serves "
                f"{serves.kind!r} versions")
    if got.kind == "lora":
        if got.base_sha256 != serves.base_sha256:
            return (f"weight version {v}: LoRA adapters of base sha256 {got.base_sha256}, "
                    f"this receiver holds base sha256 {serves.base_sha256}")
        if got.lora != serves.lora:
            return (f"weight version {v}: LoRA {got.lora} does not match this receiver's "
                    f"{serves.lora}")
    return None


def check_receivable(serves: WeightVersion, got: WeightVersion) -> None:
    """Raises `WeightVersionRefused` (naming why) unless `got` fits `serves`."""
    problem = refusal(serves, got)
    if problem is not None:
        raise WeightVersionRefused(problem)


def describe_run(cfg, init_checkpoint: str) -> WeightVersion:
    """What run config `cfg` publishes (a description): LoRA adapters of `init_checkpoint`
    with `lora.enabled`, else the full weights. The base's identity is the checkpoint's
    sha256 (read once per process: every role describes the same files alike)."""
    spec = lora_spec(cfg)
    if spec is None:
        return WeightVersion("full")
    sha = base_identity(os.fspath(init_checkpoint))["sha256"]
    return WeightVersion("lora", sha, spec)
