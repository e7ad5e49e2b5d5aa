"""`ServerState`: what the test SGLang server does behind its HTTP routes (`sglang_server.py`):
request validation and rids, generation with the embedded `JaxEngine` (or the `--stub`), aborts,
pauses, weight updates and version labels. The SGLang source each behaviour follows is cited in
`sglang_server.py`'s docstring and beside the code.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import queue
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from pipelinerl_jax.testing.sglang_faults import (DEFAULT_SWITCHES, Status, corrupt,
                                                  gap_answer)
from pipelinerl_jax.testing.sglang_lora import (AdapterRegistry, LoRARequestError,
                                                request_adapters)

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
PAUSE_MODES = ("abort", "retract", "in_place")
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids",
                  "n", "sampling_seed", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                  "spaces_between_special_tokens", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "min_new_tokens", "stop", "stream_interval"}


class BadRequest(Exception):
    """Answered as HTTP 400 {"error": {"message": ...}} (SGLang's `_create_error_response`)."""


class ServerState:
    """Everything the HTTP handlers share (one instance per process)."""

    def __init__(self, args):
        self.args = args
        self.lock = threading.Condition()
        self.step_gate = threading.Lock()
        self.switches = dict(DEFAULT_SWITCHES, startup_503_s=args.startup_503_s,
                             fail_every=args.fail_every, fail_status=args.fail_status,
                             corrupt_every=args.corrupt_every,
                             abort_every=args.abort_every,
                             abort_after_tokens=args.abort_after_tokens, delay_s=args.delay_s,
                             version_spans=not args.no_version_spans)
        self.t0 = time.monotonic()
        self.ready = False
        self.paused = False
        self.pause_mode = None
        self.record: List[dict] = []
        self.counts = collections.Counter()
        self.delays = collections.Counter()  # first rid of a /generate body -> calls delayed
        self.internal_version = 0
        self.labels = {0: args.weight_version}  # JaxEngine version -> SGLang weight_version
        self.model_path = args.model_path
        self.live: Dict[str, str] = {}  # internal request id -> public rid
        self.waiters: Dict[str, queue.Queue] = {}
        self.engine = None
        self.lora = AdapterRegistry(getattr(args, "enable_lora", False),
                                    getattr(args, "max_lora_rank", None),
                                    getattr(args, "lora_target_modules", None),
                                    getattr(args, "max_loaded_loras", None))
        if args.stub:
            self.vocab_size, self.context_len = args.vocab_size, args.context_length
            if args.model_path:
                with open(os.path.join(args.model_path, "config.json")) as f:
                    self.vocab_size = int(json.load(f)["vocab_size"])
        else:
            self._start_engine()

    # ------------------------------------------------------------------ engine

    def _start_engine(self) -> None:
        from pipelinerl_jax.rollout.jax_engine import JaxEngine
        cfg = dict(max_slots=8, max_seq_len=128, logprob_mode="tempered",
                   kv_policy=self.args.kv_policy)
        cfg.update(json.loads(self.args.engine or "{}"))
        self.engine = JaxEngine(self.args.model_path, cfg, version=0, engine_id="sglang-test")
        self.vocab_size = self.engine.model_config.vocab_size
        self.context_len = self.engine.max_seq_len
        if not self.args.no_warmup:
            self.engine.warmup()  # SGLang captures CUDA graphs before it reports healthy
        threading.Thread(target=self._route, daemon=True, name="route").start()
        threading.Thread(target=self._step_loop, daemon=True, name="step").start()

    def _step_loop(self) -> None:
        """Drives the JaxEngine (the server owns its loop, so that a test can switch it off
        with auto_step=false and step by hand: POST /_test/step {"steps": k})."""
        while True:
            with self.step_gate:  # switching auto_step off waits for the step in progress
                with self.lock:
                    auto = self.switches["auto_step"]
                produced = self.engine.step() if auto else None
            if produced is None:
                with self.lock:
                    self.lock.wait_for(lambda: self.switches["auto_step"])
            elif produced == 0:
                time.sleep(0.005)  # idle or paused

    def _route(self) -> None:
        """Hands each finished JaxEngine sample to the HTTP handler waiting for it."""
        while True:
            for c in self.engine.get_completions(timeout=0.5):
                with self.lock:
                    self.live.pop(c.request_id, None)
                    q = self.waiters.pop(c.request_id, None)
                if q is not None:
                    q.put(c)

    def label(self, internal: int) -> str:
        return self.labels.get(int(internal), self.labels[self.internal_version])

    def starting(self) -> bool:
        return not self.ready or time.monotonic() - self.t0 < self.switches["startup_503_s"]

    # ------------------------------------------------------------------ /generate

    def generate(self, body: dict) -> Any:
        if body.get("text") is not None:
            raise BadRequest("text input needs a tokenizer; this server runs with "
                             "--skip-tokenizer-init, send input_ids")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the test server")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids cannot be empty.")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        sp = body.get("sampling_params") or {}
        sps = [sp] * len(prompts) if isinstance(sp, dict) else list(sp)
        if len(sps) != len(prompts):
            raise BadRequest(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
        n = sps[0].get("n", 1) or 1
        if any((s.get("n", 1) or 1) != n for s in sps):
            raise BadRequest("The parallel_sample_num should be the same for all samples in "
                             "sample params.")
        rid = body.get("rid")
        if isinstance(rid, list) and len(rid) != len(prompts):
            raise BadRequest("The specified rids length mismatch with the batch_size for "
                             "batch processing.")
        if isinstance(rid, list) and len(set(rid)) != len(rid):
            raise BadRequest("Duplicate request IDs detected within the request: "
                             f"{sorted({r for r in rid if rid.count(r) > 1})}")
        want_logprob = body.get("return_logprob") or False
        items = []  # prompt-major: prompt i, then its n samples
        for i, (prompt, s) in enumerate(zip(prompts, sps)):
            self._check(prompt, s)
            for j in range(n):
                lp = want_logprob[i] if isinstance(want_logprob, list) else want_logprob
                items.append((_rid(rid, single, i, n), [int(t) for t in prompt], s, bool(lp)))
        try:  # admitted with their adapters (sglang_lora.py), counted in use until answered
            names = [a for a in request_adapters(body, len(prompts)) for _ in range(n)]
            adapters = self.lora.acquire(names)
        except LoRARequestError as e:
            raise BadRequest(str(e)) from None
        if self.engine is not None and any(adapters):
            self.lora.release(names)
            raise BadRequest("this test server generates with LoRA adapters only with --stub")
        try:
            return self._generate(items, adapters, single, n)
        finally:
            self.lora.release(names)

    def _generate(self, items, adapters, single: bool, n: int) -> Any:
        with self.lock:
            self.counts["generate"] += 1
            call = self.counts["generate"]
            sw = dict(self.switches)
        if sw["fail_every"] and call % sw["fail_every"] == 0:
            return Status(sw["fail_status"], {"error": {"message": f"injected failure of "
                                                                    f"request #{call}"}})
        if sw["delay_s"]:
            with self.lock:  # a client's retries resend the same body: same first rid
                self.delays[items[0][0]] += 1
            time.sleep(sw["delay_s"])
        t0 = time.time()
        results = self._run_stub(items, adapters) if self.engine is None \
            else self._run_engine(items)
        abort_k = None
        with self.lock:
            if self.switches["abort_next"] > 0 or (sw["abort_every"] and
                                                   call % sw["abort_every"] == 0):
                self.switches["abort_next"] = max(self.switches["abort_next"] - 1, 0)
                abort_k = sw["abort_after_tokens"]
        out = [self._answer(item, res, abort_k, time.time() - t0, sw["version_spans"], a)
               for item, res, a in zip(items, results, adapters)]
        out = [gap_answer(o, sw) for o in out]
        if sw["corrupt_every"] and call % sw["corrupt_every"] == 0:
            with self.lock:
                self.counts["corrupted"] += 1
            return corrupt(out, call // sw["corrupt_every"])
        return out[0] if single and n == 1 else out

    def _check(self, prompt, s: dict) -> None:
        unknown = set(s) - _SAMPLING_KEYS
        if unknown:
            raise BadRequest(f"unexpected sampling parameter(s) {sorted(unknown)}")
        if s.get("stop"):
            raise BadRequest(f"stop={s['stop']!r} is unavailable when skip_tokenizer_init=True "
                             "(requires tokenizer to decode tokens to text for matching).")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise BadRequest(f"input_ids must be token ids in [0, {self.vocab_size})")
        if len(prompt) >= self.context_len:
            raise BadRequest(f"The input ({len(prompt)} tokens) is longer than the model's "
                             f"context length ({self.context_len} tokens).")
        t, p, k = s.get("temperature", 1.0), s.get("top_p", 1.0), s.get("top_k", -1)
        if t is None or t < 0:
            raise BadRequest(f"temperature must be a non-negative finite number, got {t}.")
        if not 0.0 < (1.0 if p is None else p) <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {p}.")
        if k is not None and k != -1 and k < 1:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {k}.")
        m = s.get("max_new_tokens", 128)
        if m is not None and m < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {m}.")

    def _run_engine(self, items) -> list:
        from pipelinerl_jax.rollout.engine import RequestError
        from pipelinerl_jax.records import GenerationRequest, SamplingParams
        q: queue.Queue = queue.Queue()
        internal, results = [], [None] * len(items)
        try:
            for idx, (rid, prompt, s, _) in enumerate(items):
                max_new = s.get("max_new_tokens", 128)
                if max_new is None:
                    max_new = 128
                if max_new == 0:  # SGLang allows a prefill-only request
                    results[idx] = "empty"
                    continue
                k = s.get("top_k", -1)
                params = SamplingParams(
                    max_new_tokens=int(max_new), temperature=float(s.get("temperature", 1.0)),
                    top_p=float(s.get("top_p", 1.0)),
                    top_k=0 if k in (None, -1) or k >= min(TOP_K_ALL, self.vocab_size) else k,
                    stop_token_ids=tuple(s.get("stop_token_ids") or ()), n=1,
                    seed=s.get("sampling_seed"))
                iid = f"{rid}#{uuid.uuid4().hex[:8]}"
                with self.lock:
                    self.waiters[iid] = q
                    self.live[iid] = rid
                try:
                    self.engine.submit(GenerationRequest(iid, _np_prompt(prompt), params))
                except RequestError as e:
                    with self.lock:
                        self.waiters.pop(iid, None)
                        self.live.pop(iid, None)
                    raise BadRequest(str(e)) from None
                internal.append((iid, idx))
        except BadRequest:
            for iid, _ in internal:
                self.engine.abort(iid)
            raise
        slot = {iid: idx for iid, idx in internal}
        for _ in internal:
            c = q.get()
            results[slot[c.request_id]] = c
        return results

    def _run_stub(self, items, adapters) -> list:
        with self.lock:
            while self.paused:
                self.lock.wait()
            version = self.internal_version
        out = []
        for (rid, prompt, s, _), adapter in zip(items, adapters):
            max_new = min(s.get("max_new_tokens", 128) or 0, self.context_len - len(prompt))
            weights = "" if adapter is None else adapter["digest"]  # the adapter's files
            h = int.from_bytes(hashlib.blake2b(
                f"{prompt}|{s.get('sampling_seed')}|{rid}|{weights}".encode(),
                digest_size=8).digest(), "big")
            toks = [(h + 7919 * j) % self.vocab_size for j in range(max_new)]
            out.append(_StubResult(toks, version))
        return out

    def _answer(self, item, res, abort_k: Optional[int], latency: float, spans: bool,
                adapter: Optional[dict] = None) -> dict:
        rid, prompt, s, want_logprob = item
        if res == "empty":
            toks, logps, vers, kvs, reason = [], [], [], [], "length"
        elif isinstance(res, _StubResult):
            toks, logps = res.tokens, [-1.0] * len(res.tokens)
            vers = kvs = [res.version] * len(res.tokens)
            reason = "length"
        else:
            toks, logps = res.token_ids.tolist(), res.logp_behaviour.tolist()
            vers, kvs, reason = res.version.tolist(), res.kv_version.tolist(), res.finish_reason
        if abort_k is not None and reason != "abort":
            toks, logps, vers, kvs = toks[:abort_k], logps[:abort_k], vers[:abort_k], kvs[:abort_k]
            reason = "abort"
        with self.lock:
            labels = [self.label(v) for v in vers]
            kv_labels = [self.label(v) for v in kvs]
            current = self.labels[self.internal_version]
        if reason == "stop":
            finish = {"type": "stop", "matched": toks[-1]}
        elif reason == "length":
            finish = {"type": "length", "length": len(toks)}
        else:
            finish = {"type": "abort", "message": "Abort in waiting queue" if not toks
                      else "Aborted by request or by the server"}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                "completion_tokens": len(toks), "cached_tokens": 0, "weight_version": current,
                "e2e_latency": latency}
        if spans:
            meta["weight_versions"] = _spans(labels) or [{"version": current, "start": 0,
                                                           "end": 0}]
        if want_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, toks)]
        with self.lock:
            self.record.append({"rid": rid, "input_ids": prompt, "output_ids": toks,
                                "output_logprobs": logps, "versions": labels,
                                "kv_versions": kv_labels, "finish_reason": finish,
                                "sampling_params": s,
                                "lora_path": None if adapter is None else adapter["name"]})
        return {"output_ids": toks, "meta_info": meta}

    # ------------------------------------------------------------------ control

    def abort(self, rid: Optional[str], abort_all: bool) -> int:
        """SGLang's two-stage abort (module docstring): a rid no request holds is ignored;
        a held one aborts every request whose rid starts with it."""
        with self.lock:
            if abort_all:
                hit = list(self.live)
            elif not rid or rid not in self.live.values():
                hit = []
            else:
                hit = [iid for iid, r in self.live.items() if r.startswith(rid)]
        for iid in hit:
            self.engine.abort(iid)
        return len(hit)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        needed = {"retract": "recompute", "in_place": "keep"}.get(mode)
        if self.engine is not None and needed and self.engine.config.kv_policy != needed:
            raise BadRequest(f"this test server runs --kv-policy "
                             f"{self.engine.config.kv_policy} and cannot emulate pause mode "
                             f"{mode!r}; start it with --kv-policy {needed}")
        with self.lock:
            self.paused, self.pause_mode = True, mode
            self.counts["pause"] += 1
        if self.engine is not None:
            if mode == "abort":
                self.abort(None, abort_all=True)
            self.engine.pause()

    def resume(self) -> None:
        with self.lock:
            self.paused, self.pause_mode = False, None
            self.counts["continue"] += 1
            self.lock.notify_all()
        if self.engine is not None:
            self.engine.resume()

    def update_weights(self, body: dict):
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path: field required")
        if body.get("abort_all_requests"):
            self.abort(None, abort_all=True)
        with self.lock:
            self.counts["update_weights"] += 1
            running = bool(self.live)
            in_place = self.paused and self.pause_mode == "in_place"
        if in_place and running and body.get("flush_cache", True):
            return Status(400, {"success": False, "num_paused_requests": 0, "message":
                                 "Cache flush failed after updating weights: requests are "
                                 "paused in place (send flush_cache=false)"})
        t0 = time.perf_counter()
        try:
            if self.engine is None:
                with open(os.path.join(path, "config.json")) as f:
                    json.load(f)
            else:
                self.engine.update_weights(path, self.internal_version + 1, wait=True)
        except Exception as e:  # noqa: BLE001 - SGLang answers a failed load with 400
            return Status(400, {"success": False, "num_paused_requests": 0,
                                 "message": f"Failed to update weights: {e}. Rolling back to "
                                            f"the previous weights."})
        with self.lock:
            self.internal_version += 1
            version = body.get("weight_version")
            self.labels[self.internal_version] = (str(version) if version is not None else
                                                  self.labels[self.internal_version - 1])
            self.model_path = path
            self.counts["load_s_x1000"] += int(1000 * (time.perf_counter() - t0))
            msg = "Succeeded to update model weights."
            if version is not None:
                msg += f" Weight version updated to {version}."
        return {"success": True, "message": msg, "num_paused_requests": 0}

    def set_label(self, body: dict) -> dict:
        if body.get("abort_all_requests", True):  # SGLang's default: abort everything
            self.abort(None, abort_all=True)
        with self.lock:
            self.labels[self.internal_version] = str(body.get("new_version", ""))
        return {"success": True, "message": f"Weight version updated to "
                                            f"{body.get('new_version')}",
                "new_version": body.get("new_version")}

    def info(self) -> dict:
        with self.lock:
            return {"model_path": self.model_path, "tokenizer_path": None,
                    "is_generation": True, "preferred_sampling_params": None,
                    "weight_version": self.labels[self.internal_version]}


class _StubResult:
    def __init__(self, tokens, version):
        self.tokens, self.version = tokens, version


def _rid(rid: Any, single: bool, i: int, n: int) -> str:
    """The rid of one sample of prompt `i` (see the module docstring, "Request ids")."""
    if n > 1 or rid is None:
        return uuid.uuid4().hex  # parallel children: regenerate_rid(); no rid: a fresh one
    if isinstance(rid, list):
        return rid[i]
    return rid if single else f"{rid}_{i}"


def _np_prompt(prompt):
    import numpy as np
    return np.asarray(prompt, np.int32)


def _spans(labels: List[str]) -> List[dict]:
    """Per-token version labels -> SGLang's `weight_versions` [{version, start, end}]."""
    spans: List[dict] = []
    for t, v in enumerate(labels):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = t + 1
        else:
            spans.append({"version": v, "start": t, "end": t + 1})
    return spans
