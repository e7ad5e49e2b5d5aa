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
  POST /load_lora_adapter {lora_name, lora_path, pinned}, /unload_lora_adapter {lora_name},
       and /generate's lora_path: servers started with --enable-lora (--stub only),
       --max-lora-rank, --lora-target-modules, --max-loaded-loras; SGLang's behaviour and
       where it comes from: `sglang_lora.py`

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
/_test/stats (call counts, CPU seconds, requests live, the most delay_s sleeps one request
had: a request's retries resend its rid), POST /_test/step {steps} (runs that
many engine steps by hand). Switches: startup_503_s (health and generate answer 503 for the
first S seconds), fail_every + fail_status (every k-th /generate answers that status),
corrupt_every (every k-th /generate answers 200 with a malformed body: cut-off JSON, a NaN
log-prob, an out-of-vocabulary id, no meta_info, in turn),
abort_every / abort_next + abort_after_tokens (every k-th, or the next N, /generate calls
return their samples aborted after that many tokens, as a server-side abort does), delay_s
(sleep before answering /generate), version_spans, auto_step (false: the engine only runs
on /_test/step, so a test can place a weight update between two exact decode steps), and
sglang-jax's gaps: resend_logprobs_every, update_endpoint, weight_version_field,
lora_endpoints (see `sglang_faults.gap_answer`).
`--stub` replaces generation by a zero-cost deterministic one (token ids from a hash,
log-prob -1.0), so that a benchmark measures the client, not the model.

`sglang_state.ServerState` does the work behind the routes listed above (this module is the HTTP
layer and the entry point), `sglang_faults` holds the switches' answers, and
`sglang_process.ServerProcess` starts one as a child process and talks to its test endpoints.

Deviations from SGLang, on purpose: no text input, no streaming (400); only
`stop_token_ids` end a sample (no model EOS unless listed); a weight update while not paused
applies between two decode steps instead of first waiting for running requests to finish.
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from pipelinerl_jax.testing.sglang_faults import (DEFAULT_SWITCHES, Raw, Status, gap_info,
                                                  gap_route)
from pipelinerl_jax.testing.sglang_state import BadRequest, ServerState


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
                starting = s.starting()
                with s.lock:  # what a client saw, for tests that check it waited
                    s.counts["health_503" if starting else "health_ok"] += 1
                return Status(503, None) if starting else None
            gap = gap_route(s.switches, path)
            if gap is not None:
                return gap
            if path == "/get_model_info":
                return gap_info(s.info(), s.switches)
            if path == "/get_weight_version":
                return {"weight_version": s.info()["weight_version"]}
            if path == "/get_server_info":
                return {**s.info(), **s.lora.server_args(),
                        "skip_tokenizer_init": True, "version": "test-server",
                        "context_length": s.context_len, "max_running_requests":
                        s.engine.num_slots if s.engine is not None else None}
            if path == "/_test/record":
                with s.lock:
                    return {"record": list(s.record)}
            if path == "/_test/stats":
                with s.lock:
                    return {"counts": dict(s.counts), "cpu_s": time.process_time(),
                            "most_delays_one_request": max(s.delays.values(), default=0),
                            "paused": s.paused, "pause_mode": s.pause_mode, "live":
                            len(s.live), "weight_version": s.labels[s.internal_version],
                            "lora_loaded": list(s.lora.loaded),
                            "lora_counts": dict(s.lora.counts)}
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
            if path == "/load_lora_adapter":
                return s.lora.load(body)
            if path == "/unload_lora_adapter":
                return s.lora.unload(body)
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
                    s.delays.clear()
                return None
            return Status(404, {"error": {"message": f"no route {path}"}})

    return Handler


_POST_PATHS = {"/generate", "/pause_generation", "/continue_generation", "/abort_request",
               "/update_weights_from_disk", "/update_weight_version", "/flush_cache",
               "/_test/reset", "/load_lora_adapter", "/unload_lora_adapter"}


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
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (--stub)")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    args = p.parse_args(argv)
    if not args.stub and not args.model_path:
        p.error("--model-path is required unless --stub")
    if args.enable_lora and not args.stub:
        p.error("--enable-lora needs --stub (adapters change the stub's tokens, not a model's)")
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
