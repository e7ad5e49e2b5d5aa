"""A protocol-faithful stand-in for an SGLang server, for tests and client benchmarks.

    python -m pipelinerl_jax.testing.sglang_server --model-path DIR --port 0 \
        [--weight-version 0] [--kv-policy recompute|keep] [--engine '{"max_slots": 4}'] \
        [--stub] [--startup-delay-s S] [--startup-503-s S] [--fail-every K] [--abort-every K]
        [--corrupt-every K] [--delay-s S]

SGLang needs GPUs, so the SGLang engine is tested against this server. It speaks SGLang's
native HTTP API as read in sglang's `srt/entrypoints/http_server.py` and
`srt/managers/io_struct.py` (servers launched with `--skip-tokenizer-init`) and generates
with the embedded `JaxEngine`, so tokens and log-probs are real:

  GET  /health, /health_generate      200, or 503 while starting (warm-up, --startup-503-s)
  GET  /get_model_info                {model_path, tokenizer_path, is_generation, weight_version}
  GET  /get_server_info               server args (+ context_length, max_running_requests)
  GET  /get_weight_version            {weight_version}
  POST /generate                      input_ids [P] or [[P], ...], sampling_params dict or
                                      list (max_new_tokens, temperature, top_p, top_k (-1 =
                                      off), stop_token_ids, n, sampling_seed), rid, return_logprob.
                                      A single prompt with n = 1 answers one object, anything
                                      else a flat list, prompt-major. Each object:
                                      {output_ids, meta_info: {id, finish_reason {type: stop
                                      (matched) | length (length) | abort (message)},
                                      prompt_tokens, completion_tokens, cached_tokens,
                                      weight_version, weight_versions [{version, start, end}],
                                      output_token_logprobs [[logp, id, None], ...],
                                      e2e_latency}}
  POST /pause_generation {mode}       'abort' (default, as in SGLang) aborts what runs;
                                      'in_place' / 'retract' stop between steps
  POST /continue_generation
  POST /update_weights_from_disk      {model_path, weight_version, flush_cache,
                                      abort_all_requests}: loads the HF directory into the
                                      JaxEngine; 400 {success: false, message} if it cannot
  POST /update_weight_version         {new_version, abort_all_requests (default True)}
  POST /abort_request {rid, abort_all} see "Request ids and aborts" below
  POST /flush_cache

Request ids and aborts, as SGLang handles them (read in `srt/managers/io_struct.py`,
`srt/managers/tokenizer_manager.py`, `srt/managers/scheduler.py`):
  - a rid string on one prompt names that request; a rid list on a batch names one request
    per prompt; a rid string on a batch becomes '<rid>_<i>' per prompt; no rid, a fresh uuid
    (`GenerateReqInput._normalize_single_inputs` / `_normalize_rid`). A list with a rid twice
    is a 400 (`_validate_rid_uniqueness`);
  - `sampling_params.n > 1` expands each prompt into n children, each with a fresh uuid rid
    unrelated to the one sent (`TokenizerManager._handle_batch_request`: `regenerate_rid()`),
    and the parent's state is dropped: the answers' `meta_info.id` are the children's rids;
  - `/abort_request {rid}` is ignored unless `rid` is exactly the rid of a request in flight
    (`TokenizerManager.abort_request`: `rid not in self.rid_to_state` returns; with one
    tokenizer worker, the default), so the parent rid of an n > 1 request aborts nothing;
    a rid in flight aborts every request whose rid starts with it (the scheduler's abort
    matches `req.rid.startswith(recv_req.rid)`); `abort_all` aborts everything
    (`http_server.py` `/abort_request` passes `rid` and `abort_all`).

Log-probs are SGLang's default: log softmax(logits / T) of the sampled token, before top-k /
top-p truncation (`JaxEngine` with `logprob_mode='tempered'`). `kv_policy` emulates what a
weight update does to requests that are running: 'recompute' (SGLang's 'retract' pause, KV
flushed and recomputed) or 'keep' (its 'in_place' pause, old KV kept); a pause in the other
mode is refused with 400 rather than emulated wrongly. `weight_versions` spans are what recent
SGLang reports per request; `--no-version-spans` drops them, as older servers do.

Test-only endpoints: GET /_test/record (every sample it returned: rid, input_ids, output_ids,
output_logprobs, per-token version labels and KV version labels, finish_reason,
sampling_params), POST /_test/reset, GET|POST /_test/config (switches below), GET
/_test/stats (call counts, CPU seconds, requests live), POST /_test/step {steps} (runs that
many engine steps by hand). Switches: startup_503_s (health and generate answer 503 for the
first S seconds), fail_every + fail_status (every k-th /generate answers that status),
corrupt_every (every k-th /generate answers 200 with a malformed body: cut-off JSON, a NaN
log-prob, an out-of-vocabulary id, no meta_info, in turn),
abort_every / abort_next + abort_after_tokens (every k-th, or the next N, /generate calls
return their samples aborted after that many tokens, as a server-side abort does), delay_s
(sleep before answering /generate), version_spans, auto_step (false: the engine only runs
on /_test/step, so a test can place a weight update between two exact decode steps), and
sglang-jax's gaps: resend_logprobs_every, update_endpoint, weight_version_field (see
`sglang_faults.gap_answer`).
`--stub` replaces generation by a zero-cost deterministic one (token ids from a hash,
log-prob -1.0), so that a benchmark measures the client, not the model.

`sglang_process.ServerProcess` starts one as a child process and talks to its test endpoints;
`sglang_faults` holds the switches' answers.

Deviations from SGLang, on purpose: no text input, no streaming (400); only
`stop_token_ids` end a sample (no model EOS unless listed); a weight update while not paused
applies between two decode steps instead of first waiting for running requests to finish.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import http.server
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from pipelinerl_jax.testing.sglang_faults import (DEFAULT_SWITCHES, Raw, Status, corrupt,
                                                  gap_answer, gap_info, gap_route)

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
        self.internal_version = 0
        self.labels = {0: args.weight_version}  # JaxEngine version -> SGLang weight_version
        self.model_path = args.model_path
        self.live: Dict[str, str] = {}  # internal request id -> public rid
        self.waiters: Dict[str, queue.Queue] = {}
        self.engine = None
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
        with self.lock:
            self.counts["generate"] += 1
            call = self.counts["generate"]
            sw = dict(self.switches)
        if sw["fail_every"] and call % sw["fail_every"] == 0:
            return Status(sw["fail_status"], {"error": {"message": f"injected failure of "
                                                                    f"request #{call}"}})
        if sw["delay_s"]:
            time.sleep(sw["delay_s"])
        t0 = time.time()
        results = self._run_stub(items) if self.engine is None else self._run_engine(items)
        abort_k = None
        with self.lock:
            if self.switches["abort_next"] > 0 or (sw["abort_every"] and
                                                   call % sw["abort_every"] == 0):
                self.switches["abort_next"] = max(self.switches["abort_next"] - 1, 0)
                abort_k = sw["abort_after_tokens"]
        out = [self._answer(item, res, abort_k, time.time() - t0, sw["version_spans"])
               for item, res in zip(items, results)]
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
        from pipelinerl_jax.types import GenerationRequest, SamplingParams
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

    def _run_stub(self, items) -> list:
        with self.lock:
            while self.paused:
                self.lock.wait()
            version = self.internal_version
        out = []
        for rid, prompt, s, _ in items:
            max_new = min(s.get("max_new_tokens", 128) or 0, self.context_len - len(prompt))
            h = int.from_bytes(hashlib.blake2b(
                f"{prompt}|{s.get('sampling_seed')}|{rid}".encode(), digest_size=8).digest(), "big")
            toks = [(h + 7919 * j) % self.vocab_size for j in range(max_new)]
            out.append(_StubResult(toks, version))
        return out

    def _answer(self, item, res, abort_k: Optional[int], latency: float, spans: bool) -> dict:
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
                                "sampling_params": s})
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


def make_handler(state: ServerState):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

        def log_message(self, *args):  # quiet: tests read stdout for the port line
            pass

        def setup(self):
            super().setup()
            # Headers and body leave in two writes: without this, Nagle + delayed ACK add
            # ~40 ms to every answer on a kept-alive connection.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _send(self, status: int, body: Any = None) -> None:
            raw = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise BadRequest(f"body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            return body

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            try:
                body = self._body() if method == "POST" else {}
                result = self._route(method, self.path.split("?")[0], body)
            except BadRequest as e:
                result = Status(400, {"error": {"message": str(e)}})
            except Exception as e:  # noqa: BLE001 - a server bug is a 500, never a hang
                result = Status(500, {"error": {"message": f"{type(e).__name__}: {e}"}})
            if isinstance(result, Raw):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(result.body)))
                self.end_headers()
                self.wfile.write(result.body)
            elif isinstance(result, Status):
                self._send(result.status, result.body)
            else:
                self._send(200, result)

        def _route(self, method: str, path: str, body: dict):
            s = state
            if path in ("/health", "/health_generate"):
                return Status(503, None) if s.starting() else None
            gap = gap_route(s.switches, path)
            if gap is not None:
                return gap
            if path == "/get_model_info":
                return gap_info(s.info(), s.switches)
            if path == "/get_weight_version":
                return {"weight_version": s.info()["weight_version"]}
            if path == "/get_server_info":
                return {**s.info(), "skip_tokenizer_init": True, "version": "test-server",
                        "context_length": s.context_len, "max_running_requests":
                        s.engine.num_slots if s.engine is not None else None}
            if path == "/_test/record":
                with s.lock:
                    return {"record": list(s.record)}
            if path == "/_test/stats":
                with s.lock:
                    return {"counts": dict(s.counts), "cpu_s": time.process_time(),
                            "paused": s.paused, "pause_mode": s.pause_mode, "live":
                            len(s.live), "weight_version": s.labels[s.internal_version]}
            if path == "/_test/config":
                unknown = set(body) - set(DEFAULT_SWITCHES)
                if unknown:
                    raise BadRequest(f"unknown switches {sorted(unknown)}")
                with s.step_gate, s.lock:
                    s.switches.update(body)
                    s.lock.notify_all()
                    return dict(s.switches)
            if path == "/_test/step":
                produced = sum(s.engine.step() for _ in range(int(body.get("steps", 1))))
                return {"tokens": produced}
            if method != "POST":
                return Status(405 if path in _POST_PATHS else 404,
                               {"error": {"message": f"{method} {path} is not served"}})
            if path == "/generate":
                return Status(503, {"error": {"message": "server is starting"}}) \
                    if s.starting() else s.generate(body)
            if path == "/pause_generation":
                s.pause(body.get("mode", "abort"))
                return {"message": "Generation paused successfully.", "status": "ok"}
            if path == "/continue_generation":
                s.resume()
                return {"message": "Generation continued successfully.", "status": "ok"}
            if path == "/update_weights_from_disk":
                return s.update_weights(body)
            if path == "/update_weight_version":
                return s.set_label(body)
            if path == "/abort_request":
                with s.lock:
                    s.counts["abort_request"] += 1
                s.abort(body.get("rid"), bool(body.get("abort_all")))
                return None
            if path == "/flush_cache":  # refused while requests run (SGLang's scheduler
                with s.lock:  # flush_cache; http_server answers 400; sglang-jax, measured)
                    busy = bool(s.live)
                return Status(400, "Cache not flushed: there are pending requests") \
                    if busy else None
            if path == "/_test/reset":
                with s.lock:
                    s.record.clear()
                    s.counts.clear()
                return None
            return Status(404, {"error": {"message": f"no route {path}"}})

    return Handler


_POST_PATHS = {"/generate", "/pause_generation", "/continue_generation", "/abort_request",
               "/update_weights_from_disk", "/update_weight_version", "/flush_cache",
               "/_test/reset"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="", help="HF checkpoint directory (local)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--kv-policy", choices=("recompute", "keep"), default="recompute",
                   help="recompute = SGLang 'retract' pauses, keep = 'in_place' pauses")
    p.add_argument("--engine", default="", help="JSON overrides of the JaxEngine config")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-version-spans", action="store_true",
                   help="omit meta_info.weight_versions, as SGLang before per-token spans")
    p.add_argument("--stub", action="store_true", help="zero-cost generation (benchmarks)")
    p.add_argument("--vocab-size", type=int, default=64, help="--stub without --model-path")
    p.add_argument("--context-length", type=int, default=4096, help="--stub")
    p.add_argument("--startup-delay-s", type=float, default=0.0,
                   help="stay in the starting phase (503, as while loading) this long")
    p.add_argument("--startup-503-s", type=float, default=0.0)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--abort-every", type=int, default=0)
    p.add_argument("--abort-after-tokens", type=int, default=2)
    p.add_argument("--corrupt-every", type=int, default=0,
                   help="every k-th /generate answers a malformed body (CORRUPTIONS)")
    p.add_argument("--delay-s", type=float, default=0.0)
    args = p.parse_args(argv)
    if not args.stub and not args.model_path:
        p.error("--model-path is required unless --stub")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Bind first and announce the port, so a parent can poll /health (503) during warm-up.
    server = http.server.ThreadingHTTPServer((args.host, args.port), lambda *a: None)
    server.daemon_threads = True
    port = server.server_address[1]
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)

    class Starting(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            raw = json.dumps({"error": {"message": "server is starting"}}).encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(raw)))
            # A kept-alive connection would stay with this handler class for good.
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = _answer

    server.RequestHandlerClass = Starting
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(args.startup_delay_s)
    state = ServerState(args)
    server.RequestHandlerClass = make_handler(state)
    state.ready = True
    print(json.dumps({"ready": True, "port": port}), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
