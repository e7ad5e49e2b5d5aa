"""SGLang's native `/generate` as the engine speaks it: request bodies and answer parsing.

Pure functions over the engine's bookkeeping (`Sample`: one of the `n` samples of a request;
`Job`: one HTTP call), kept apart from the engine's threads so they can be read alone.
Field names follow sglang's `GenerateReqInput` / `SamplingParams` (`srt/managers/io_struct.py`,
`srt/sampling/sampling_params.py`) and the answers its tokenizer manager builds.

Two request forms (both with `return_logprob: true`, answered prompt-major):
  single     one sample: `input_ids` [P] (prompt + tokens so far when resubmitted), one answer
             object;
  batched    `n` samples: `n` copies of the prompt, a list of `n` answers; with a seed, one
             `sampling_seed` each (SGLang's seeded sampler hashes (seed, position), so copies
             sharing a seed would be equal).
Every sample has its own server rid, '<request id>/<job number>/<sample index>', so
`/abort_request` reaches each one. `sampling_params.n` is never sent: SGLang gives the children
of such a request fresh uuid rids (`tokenizer_manager.py` `_handle_batch_request`,
`io_struct.py` `regenerate_rid`) and forgets the parent rid, which `abort_request` then ignores.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, List, Optional

import numpy as np

from pipelinerl_jax.rollout.sglang_client import HTTPError
from pipelinerl_jax.records import GenerationRequest

_INT = re.compile(r"^-?\d+$")
_MISSING = np.iinfo(np.int32).min
_INT32_MAX = np.iinfo(np.int32).max


class ProtocolError(Exception):
    """An answer that does not have SGLang's shape."""


def version_of(label: Any) -> int:
    """SGLang's `weight_version` label -> our integer version ('default' etc. -> -1)."""
    s = str(label).strip() if label is not None else ""
    return int(s) if _INT.match(s) else -1


@dataclasses.dataclass(eq=False)
class Sample:
    request: GenerationRequest
    index: int
    prompt: np.ndarray
    seed: Optional[int]  # this sample's sampling_seed (None: the server draws)
    max_new: int  # budget, already capped by the context
    submit_time: float
    start_time: float = 0.0
    start_version: Optional[int] = None
    tokens: list = dataclasses.field(default_factory=list)  # one array per answered segment
    logps: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    kv_versions: list = dataclasses.field(default_factory=list)
    resubmits: int = 0
    inexact: bool = False  # a server refit mid-request and reported no per-token spans
    done: bool = False

    @property
    def n_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    def sequence(self) -> List[int]:
        return np.concatenate([self.prompt, *self.tokens]).astype(np.int64).tolist()


@dataclasses.dataclass(eq=False)
class Job:
    """One /generate call: all `n` samples of a request, or one resubmitted sample."""
    samples: List[Sample]
    name: str  # '<request id>/<job number>'
    reroutes: int = 0
    server: Any = None  # the engine's server record, once sent
    sent_version: Optional[int] = None  # that server's version when the job was sent
    adapter: Optional[str] = None  # LoRA: the adapter the job names (`lora_path`), if any


def sample_rid(job: Job, smp: Sample) -> str:
    return f"{job.name}/{smp.index}"


def abort_rids(job: Job) -> List[str]:
    """What `/abort_request` needs to stop `job`: each sample's rid (SGLang aborts only a rid
    it holds: `TokenizerManager.abort_request`)."""
    return [sample_rid(job, smp) for smp in job.samples]


def generate_body(job: Job) -> dict:
    first = job.samples[0]
    p = first.request.params
    sp = {"temperature": float(p.temperature), "top_p": float(p.top_p),
          "top_k": int(p.top_k) if p.top_k > 0 else -1,
          "stop_token_ids": [int(t) for t in p.stop_token_ids or ()],
          "no_stop_trim": True}  # the stop token stays in output_ids (and in training)
    body = {"return_logprob": True}
    if len(job.samples) == 1:  # a single sample, maybe resubmitted with its prefix
        body["input_ids"] = first.sequence()
        body["rid"] = sample_rid(job, first)
        body["sampling_params"] = dict(sp, max_new_tokens=first.max_new - first.n_generated)
        if first.seed is not None:
            body["sampling_params"]["sampling_seed"] = first.seed
    else:  # batched, seeded or not: one rid per sample (never sampling_params.n)
        body["input_ids"] = [smp.sequence() for smp in job.samples]
        body["rid"] = [sample_rid(job, smp) for smp in job.samples]
        body["sampling_params"] = [
            dict(sp, max_new_tokens=smp.max_new,
                 **({} if smp.seed is None else {"sampling_seed": smp.seed}))
            for smp in job.samples]
    if job.adapter is not None:  # GenerateReqInput.lora_path: the adapter's name, per prompt
        body["lora_path"] = job.adapter if len(job.samples) == 1 else \
            [job.adapter] * len(job.samples)
    return body


def answer_items(answer: Any, job: Job) -> list:
    """The answer's output objects, one per sample of `job`, in its order."""
    items = [answer] if isinstance(answer, dict) else answer
    if not isinstance(items, list) or len(items) != len(job.samples):
        raise ProtocolError(f"expected {len(job.samples)} outputs, got {type(answer).__name__}"
                            f" of {len(items) if isinstance(items, list) else '?'}")
    return items


def _int(value: Any, field: str) -> int:
    """A JSON integer (not a bool, not a float) or ProtocolError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{field}: must be an integer, got {value!r:.60}")
    return value


def _label_version(label: Any, field: str) -> int:
    """`version_of`, refusing integer labels below -1 (ours are versions >= 0; -1 is also
    what a non-integer label such as SGLang's 'default' means: unknown)."""
    v = version_of(label)
    if not -1 <= v <= _INT32_MAX:
        raise ProtocolError(f"{field}: weight version {label!r:.60} is out of range")
    return v


def parse_output(item: Any, job: Job, pause_mode: str, *, vocab_size: Optional[int] = None,
                 max_tokens: Optional[int] = None, lora: bool = False) -> dict:
    """One output object -> {tokens, logps, versions, kv_versions, reason, exact}.

    versions: `meta_info.weight_versions` spans when present, else (older servers) the label
    at answer time if the server was not refit meanwhile, else the version it had when the
    job was sent, for every token (`exact=False`); no label at all (sglang-jax): the engine's
    record of the server's version stands in for it. kv_versions: by pause mode, see the
    engine's docstring ('in_place': the segment's first version; else equal to versions).
    `lora`: versions are LoRA adapters, one per request (`job.adapter`, fixed when SGLang
    admits the request, `lora_registry.acquire`): every token, and the KV it attended to
    (prefilled and decoded with that adapter), is `job.sent_version`; the server's
    `weight_version` labels only its base and are not read.

    Anything not of SGLang's shape raises `ProtocolError` naming the field: token ids must
    be integers in [0, vocab_size), log-probs finite and <= 0, at most `max_tokens` tokens
    (the sample's remaining budget), spans integers within the output. Log-probs a server
    resent (`drop_resent_logprobs`) are dropped first.
    """
    if not isinstance(item, dict):
        raise ProtocolError(f"output: must be a JSON object, got {type(item).__name__}")
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise ProtocolError("meta_info: missing or not an object")
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise ProtocolError("meta_info.output_token_logprobs missing (return_logprob)")
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) >= 2
                                              for p in pairs):
        raise ProtocolError("meta_info.output_token_logprobs: must be a list of "
                            "[logprob, token_id, ...] entries")
    ids = item.get("output_ids")
    if ids is not None and not isinstance(ids, list):
        raise ProtocolError(f"output_ids: must be a list, got {type(ids).__name__}")
    pairs = drop_resent_logprobs(pairs, ids, meta)
    field = "meta_info.output_token_logprobs"
    pair_ids = [_int(p[1], f"{field}[{i}] token id") for i, p in enumerate(pairs)]
    tokens = pair_ids if ids is None else [_int(t, f"output_ids[{i}]")
                                           for i, t in enumerate(ids)]
    if len(pairs) != len(tokens) or pair_ids != tokens:
        raise ProtocolError("output_token_logprobs do not match output_ids")
    if max_tokens is not None and len(tokens) > max_tokens:
        raise ProtocolError(f"output_ids: {len(tokens)} tokens, more than the {max_tokens} "
                            "asked for")
    for i, t in enumerate(tokens):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ProtocolError(f"output_ids[{i}]: token id {t} outside the vocabulary "
                                f"[0, {vocab_size if vocab_size is not None else 'V'})")
    logps = []
    for i, p in enumerate(pairs):
        x = p[0]
        if x is None:
            raise ProtocolError("a generated token has no log-prob")
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
                or x > 0:
            raise ProtocolError(f"{field}[{i}]: log-prob must be a finite number <= 0, "
                                f"got {x!r:.60}")
        logps.append(float(x))
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if not isinstance(kind, str) or kind not in ("stop", "length", "abort"):
        raise ProtocolError(f"unknown finish_reason {fr!r:.100}")
    if kind == "abort" and isinstance(fr, dict) and fr.get("status_code") == 400:
        raise HTTPError(job.server.url, "/generate", 400, str(fr.get("message")))
    c = len(tokens)
    if lora:
        v = -1 if job.sent_version is None else int(job.sent_version)
        versions, exact = np.full((c,), v, np.int32), True
        return dict(tokens=np.asarray(tokens, np.int32), logps=np.asarray(logps, np.float32),
                    versions=versions, kv_versions=versions.copy(), reason=kind, exact=exact)
    versions, exact = token_versions(meta, c, job.sent_version,
                                     getattr(job.server, "version", None))
    kv = np.full((c,), versions[0], np.int32) if pause_mode == "in_place" and c \
        else versions.copy()
    return dict(tokens=np.asarray(tokens, np.int32), logps=np.asarray(logps, np.float32),
                versions=versions, kv_versions=kv, reason=kind, exact=exact)


_END = object()  # a separator equal to no log-prob entry


def drop_resent_logprobs(pairs: list, ids: Optional[list], meta: dict) -> list:
    """`meta_info.output_token_logprobs` without the prefixes a server sent again.

    sglang-jax (0.1.0rc0) flushes a non-streamed request every 50 tokens and each flush
    resends the log-probs from offset 0, which its tokenizer manager appends: a 120-token
    answer carries 50 + 100 + 120 entries. The last `meta_info.completion_tokens` entries are
    the answer's; they are kept only when every entry before them belongs to a copy of one of
    their prefixes, otherwise `ProtocolError` (never a silently shifted alignment).
    """
    field = "meta_info.output_token_logprobs"
    c = meta.get("completion_tokens")
    expected = len(ids) if ids is not None else c
    if isinstance(expected, bool) or not isinstance(expected, int) or len(pairs) <= expected:
        return pairs  # the usual answer (a shortfall is reported by the caller)
    if c is None:
        raise ProtocolError(f"{field}: {len(pairs)} entries for {expected} output_ids and no "
                            "meta_info.completion_tokens to tell which are the answer's")
    c = _int(c, "meta_info.completion_tokens")
    if ids is not None and c != len(ids):
        raise ProtocolError(f"meta_info.completion_tokens: {c}, but the answer has "
                            f"{len(ids)} output_ids")
    tail, lead = pairs[len(pairs) - c:], pairs[:len(pairs) - c]
    if not c or not _made_of_prefixes(lead, tail):
        raise ProtocolError(f"{field}: {len(pairs)} entries for {c} completion_tokens, and the "
                            f"first {len(lead)} are not resent prefixes of the last {c}")
    return tail


def _made_of_prefixes(lead: list, tail: list) -> bool:
    """Whether `lead` splits into pieces that each equal some prefix `tail[:k]`."""
    s = tail + [_END] + lead
    z = [0] * len(s)  # z[i]: length of the longest common prefix of s[i:] and s
    left = right = 0
    for i in range(1, len(s)):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < len(s) and s[z[i]] == s[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    off, reach = len(tail) + 1, 0  # lead[:p] splits for every p <= reach
    for p in range(len(lead)):
        if p > reach:
            return False
        reach = max(reach, p + z[off + p])
    return reach >= len(lead)


def token_versions(meta: dict, c: int, sent_version: Optional[int],
                   server_version: Optional[int] = None):
    """(int32 [c] versions, exact) of one output's tokens (see `parse_output`).

    A server that reports no `weight_version` at all (sglang-jax) is taken to hold what the
    engine installed: `server_version` (the engine's record now), else `sent_version`."""
    spans = meta.get("weight_versions")
    if spans is not None and not isinstance(spans, list):
        raise ProtocolError("meta_info.weight_versions: must be a list of spans")
    if spans:
        out = np.full((c,), _MISSING, np.int32)
        for i, sp in enumerate(spans):
            field = f"meta_info.weight_versions[{i}]"
            if not isinstance(sp, dict):
                raise ProtocolError(f"{field}: must be an object {{version, start, end}}")
            start, end = _int(sp.get("start"), f"{field}.start"), _int(sp.get("end"),
                                                                     f"{field}.end")
            if not 0 <= start <= end <= c:
                raise ProtocolError(f"{field}: span [{start}, {end}) outside the {c} tokens")
            out[start:end] = _label_version(sp.get("version"), f"{field}.version")
        if not (out == _MISSING).any():
            return out, True
    label = meta.get("weight_version")
    if label is None:
        at_end = server_version if server_version is not None else sent_version
        at_end = -1 if at_end is None else at_end
    else:
        at_end = _label_version(label, "meta_info.weight_version")
    sent = at_end if sent_version is None else sent_version
    return np.full((c,), min(sent, at_end), np.int32), sent == at_end or c == 0
