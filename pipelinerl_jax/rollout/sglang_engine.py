"""`SGLangEngine`: rollouts from SGLang servers over HTTP, behind the `InferenceEngine` API.

At scale, sampling runs on SGLang servers on their own GPUs while the JAX learner trains
elsewhere. This engine is a drop-in for the embedded `JaxEngine`: the rollout worker submits
`GenerationRequest`s and reads `Completion`s with per-token `logp_behaviour`, `version` and
`kv_version`; the learner's versions reach the servers through `update_weights`.

Generation. One HTTP `POST /generate` per request (servers run with `--skip-tokenizer-init`;
we send `input_ids` and read `output_ids`). A request's `n` samples go in SGLang's batched
form: `n` copies of the prompt, each with a rid of its own and, when the request has a seed,
its own `sampling_seed` (SGLang's seeded sampler hashes (seed, position), so copies sharing
one seed would be identical; unseeded copies get engine-drawn seeds, which a server ignores
unless it runs with deterministic sampling, where copies without one would be identical).
`sampling_params.n` is never sent: SGLang gives the children of
such a request fresh rids (`tokenizer_manager.py` `_handle_batch_request`, `regenerate_rid()`)
and forgets the parent's, so no `/abort_request` could reach them and `abort()` / `close()`
would leave them generating. The answer is a flat list, prompt-major. Requests are not merged
across prompts: a group is returned as soon as its own samples finish. The wire format
(bodies, rids, answer parsing, version spans) is in `sglang_protocol.py`. A pool of threads
(one per request in flight) sends them, each to the least-loaded healthy server.

Servers (`sglang_servers.py`: the engine's `ServerFleet`, `engine.fleet`): least-loaded
routing up to `sglang.concurrency_per_server` samples per server, health checks, removal and
readmission, and refits: `update_weights(path, version)` pauses every server, loads the HF
directory (`/update_weights_from_disk`) and continues, with the pause mode below.

Provenance. `version[t]` comes from the server: recent SGLang reports per-token spans
(`meta_info.weight_versions`, labels = our integer versions); older servers report only the
version at answer time (`meta_info.weight_version`). Then, if the server was refit while the
request ran, the split point is unknown and every token gets the version the server had when
the request was sent (the oldest possible: lag is over- never under-stated) and the sample
is counted in `stats()['inexact_provenance_samples']`; `pause_mode='abort'` avoids this.
SGLang does not report KV provenance; we record what each pause mode implies:
  'in_place'  requests keep their KV across the update (`flush_cache=false`): every token of a
              server request attended to KV written from its first token on, so
              `kv_version[t]` = version of the request's first token (PipelineRL's 'keep');
  'retract'   running requests are retracted, the cache flushed and the KV recomputed with the
              new weights on resume (AReaL's 'recompute'): `kv_version[t] = version[t]`;
  'abort'     running requests are aborted and resubmitted with their prefix (see below), a new
              request prefilled with the new weights: `kv_version[t] = version[t]`.

Robustness. 502/503/504 and connection errors are retried with exponential backoff and
jitter. A 4xx is the request's fault: it surfaces as `RequestError` (naming request, server
and the server's message) from `generate()` / `get_completions()`. A sample the server aborted
is resubmitted with its prefix (prompt + tokens so far, `max_new_tokens` reduced, provenance
of the generated part kept) up to `max_resubmits` times (`on_abort='resubmit'`), or returned
with finish reason 'abort' and counted (`on_abort='drop'`: the group stays whole; the reward
treats it as truncated). A server that stays unreachable is removed from routing and its
requests go to the others (`sglang_servers.py`).

LoRA (`serves` a 'lora' `WeightVersion`, docs/lora.md): a version is the adapters only, as a
PEFT directory (`models.peft_io`; the learner's 'hf_dir' sink writes one per version, arrays
are written here by the same writer, `weight_sink.write_weight_version`). The fleet loads it with `/load_lora_adapter` under a version-named adapter (no pause)
and every request sent afterwards names it (`lora_path`); a request runs to its end on the
adapter it was admitted with, so every token's `version` and `kv_version` is that adapter's
(exact; the servers' `weight_version` labels only their base). Old adapters are unloaded once
no request of ours uses them. At start-up the servers must have `/load_lora_adapter` and
`/unload_lora_adapter` (sglang-jax has neither: refused, naming it) and report, in
`/get_server_info`, `--enable-lora` with a `--max-lora-rank` and `--lora-target-modules`
that fit the spec.

`make_sglang_engine` builds a rollout worker's engine: the 'sglang' row of `rollout/factory.py`
(config section: `sglang_config.py`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from pipelinerl_jax.models.factory import resolve_model_config
from pipelinerl_jax.rollout.engine import (EngineClosedError, InferenceEngine, RequestError,
                                           completion_from_chunks, has_ready, take_ready,
                                           validate_request)
from pipelinerl_jax.rollout.engine_stats import StatsWindow, window_rates
from pipelinerl_jax.rollout.sglang_client import (LORA_ENDPOINTS, LORA_HINT, HTTPError,
                                                  ServerClient, ServerUnavailable,
                                                  require_endpoints, require_lora_server)
from pipelinerl_jax.rollout.sglang_config import sglang_config, validate_sglang_config
from pipelinerl_jax.rollout.sglang_protocol import (Job, ProtocolError, Sample, abort_rids,
                                                    answer_items, generate_body, parse_output)
from pipelinerl_jax.rollout.sglang_servers import Server, ServerFleet
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport import weight_sink
from pipelinerl_jax.transport.weight_version import (WeightVersion, check_receivable,
                                                     describe_run)
from pipelinerl_jax.records import Completion, GenerationRequest

log = logging.getLogger(__name__)


class SGLangEngine(InferenceEngine):
    """Samples from SGLang servers (module docstring). Thread-safe.

    `urls`: the servers. `vocab_size` / `max_seq_len`: the model's, for request validation
    and the context cap (a sample ends with 'length' when prompt + tokens reach
    `max_seq_len`). `version`: the engine's starting version (None: read the servers'
    `weight_version`). `weights_dir` and `model_config`: where and how `update_weights`
    writes weights given as arrays (a path is used as is). `wait_ready=False` skips the
    startup wait for /health (every server is routed to at once). `require_refit`: fail now
    (`MissingEndpointError`, naming server and endpoint) if a server cannot be refit.
    `serves`: what the versions are (a `WeightVersion` description; a message of another
    kind, base or LoRA shape is refused). For 'lora' (module docstring) `require_refit`
    probes the LoRA endpoints and server args instead.

    The engine owns the requests (queue, samples, answers, resubmits); its `ServerFleet`
    (`self.fleet`) owns the servers (routing, health, pause, refits and the live version).
    """

    def __init__(self, urls: Sequence[str], config: Optional[Mapping] = None, *,
                 vocab_size: int, max_seq_len: int, version: Optional[int] = None,
                 engine_id: str = "sglang", weights_dir: Optional[str] = None,
                 model_config: Any = None, wait_ready: bool = True,
                 require_refit: bool = False,
                 serves: WeightVersion = WeightVersion("full")):
        cfg = sglang_config()
        if config is not None:
            cfg.update(dict(config))
        cfg.urls = tuple(urls)
        validate_sglang_config(cfg, required=True)
        self.config = cfg
        self.engine_id = engine_id
        self.vocab_size, self.max_seq_len = int(vocab_size), int(max_seq_len)
        self.weights_dir, self.model_config = weights_dir, model_config
        self.serves = serves.description()
        lora = self.lora = serves.lora
        retry = RetryPolicy(cfg.backoff_initial_s, cfg.backoff_max_s)
        servers = [Server(ServerClient(u, connect_timeout_s=cfg.connect_timeout_s,
                                       max_retries=cfg.max_retries, retry=retry,
                                       api_key=cfg.api_key),
                          cfg.concurrency_per_server) for u in cfg.urls]
        self.num_slots = cfg.concurrency_per_server * len(servers)

        self._cv = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self.fleet = ServerFleet(servers, cfg, self._cv, self._stop, engine_id,
                                 lora=lora is not None)
        self._pending: collections.deque = collections.deque()  # jobs not yet sent
        self._outbox: collections.deque = collections.deque()
        self._failures: Dict[str, str] = {}  # request id -> message (4xx, protocol)
        self._live: Dict[str, List[Sample]] = {}  # request id -> its unfinished samples
        self._seed_rng = np.random.default_rng()  # unseeded n>1 copies (submit)
        self._aborted: set = set()
        self._closed = False
        self._job_seq = 0
        self._stats = StatsWindow()

        self.fleet.bring_up(wait_ready)
        if require_refit and lora is not None:  # adapters: LoRA endpoints and server args
            up = [s.client for s in servers if s.up]
            require_endpoints(up, LORA_ENDPOINTS, "loads a LoRA adapter every version",
                              LORA_HINT)
            require_lora_server(up, lora.rank, lora.targets)
        elif require_refit:  # probed once, at start-up: never a failed refit mid-run
            require_endpoints([s.client for s in servers if s.up])
        self.fleet.read_versions(version)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.num_slots + len(servers), thread_name_prefix=f"{engine_id}-http")
        self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True,
                                            name=f"{engine_id}-dispatch")
        self._dispatcher.start()
        self.fleet.start_threads()

    # ------------------------------------------------------------------ requests

    @property
    def version(self) -> int:
        return self.fleet.version

    def submit(self, request: GenerationRequest) -> None:
        prompt = validate_request(request, self.vocab_size, self.max_seq_len)
        p = request.params
        max_new = min(int(p.max_new_tokens), self.max_seq_len - len(prompt))
        now = time.time()
        n = int(p.n)
        seeds: List[Optional[int]] = [None] * n
        if p.seed is not None:  # one sampling_seed per sample (see module docstring)
            seeds = [int(np.random.default_rng([int(p.seed) % 2**63, i]).integers(2**31))
                     for i in range(n)]
        elif n > 1:  # distinct copies also on a server with deterministic sampling on, where
            # an unseeded copy samples with the same default seed (sglang-jax, measured)
            seeds = [int(s) for s in self._seed_rng.integers(2**31, size=n)]
        samples = [Sample(request, i, prompt, seeds[i], max_new, now) for i in range(n)]
        with self._cv:
            self._check_open()
            if request.request_id in self._live:
                raise RequestError(f"request {request.request_id!r}: request_id is already "
                                   "in flight on this engine")
            self._live[request.request_id] = list(samples)
            self._enqueue(Job(samples, self._name(request.request_id)))

    def _stopped(self) -> Optional[str]:
        return "closed" if self._closed else None

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(f"engine {self.engine_id} is closed")

    def _name(self, rid: str) -> str:
        self._job_seq += 1
        return f"{rid}/{self._job_seq}"

    def _enqueue(self, job: Job) -> None:  # holds _cv
        self._pending.append(job)
        self._cv.notify_all()

    def submit_batch(self, requests: Sequence[GenerationRequest]) -> None:
        """Submits `requests` one by one after checking them all (all or nothing)."""
        requests = list(requests)
        for r in requests:
            validate_request(r, self.vocab_size, self.max_seq_len)
        for r in requests:
            self.submit(r)

    def get_completions(self, timeout: Optional[float] = 0.0,
                        max_items: Optional[int] = None, *,
                        request_ids: Optional[AbstractSet[str]] = None) -> List[Completion]:
        deadline = None if timeout is None else time.monotonic() + timeout

        def failed():
            return sorted(self._failures if request_ids is None
                          else set(self._failures) & set(request_ids))

        with self._cv:
            while not has_ready(self._outbox, request_ids) and not failed():
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._closed:
                    break
                self._cv.wait(left)
            bad = failed()
            if bad:
                rid = next(iter(self._failures)) if request_ids is None else bad[0]
                raise RequestError(self._failures.pop(rid), request_id=rid)
            return take_ready(self._outbox, request_ids, max_items)

    def abort(self, request_id: str) -> int:
        """Queued samples end at once; running ones when their server answers the abort
        (with the tokens generated so far). Returns how many samples were unfinished."""
        with self._cv:
            samples = [s for s in self._live.get(request_id, []) if not s.done]
            if not samples:
                return 0
            self._aborted.add(request_id)
            queued = [j for j in self._pending if j.samples[0].request.request_id == request_id]
            for j in queued:
                self._pending.remove(j)
            running = [j for j in self.fleet.running_jobs()
                       if j.samples[0].request.request_id == request_id]
            for j in queued:
                for smp in j.samples:
                    self._finish(smp, "abort")
        for j in running:  # the server answers them with finish_reason 'abort'
            self._abort_on_server(j)
        return len(samples)

    def _abort_on_server(self, job: Job) -> None:
        s = job.server
        if s is None:
            return
        for rid in abort_rids(job):
            try:
                s.client.post("/abort_request", {"rid": rid, "abort_all": False},
                              timeout=self.config.control_timeout_s, retries=1)
            except (HTTPError, ServerUnavailable) as e:
                log.warning("abort of %s on %s failed: %s", rid, s.url, e)

    # ------------------------------------------------------------------ dispatch

    def _dispatch_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop.is_set() and (
                        self.fleet.paused or not self._pending or self.fleet.pick() is None):
                    self._cv.wait()
                if self._stop.is_set():
                    return
                job = self._pending.popleft()
                self.fleet.assign(job, self.fleet.pick())
                now = time.time()
                for smp in job.samples:
                    if not smp.start_time:
                        smp.start_time = now
            try:
                self._executor.submit(self._run_job, job)
            except RuntimeError:  # closed meanwhile: close() returns its samples as 'abort'
                return

    def _run_job(self, job: Job) -> None:
        s = job.server
        error: Optional[str] = None
        try:
            answer = s.client.post("/generate", generate_body(job),
                                   timeout=self.config.request_timeout_s, stop=self._stop)
            segments = [parse_output(item, job, self.config.pause_mode,
                                     vocab_size=self.vocab_size,
                                     max_tokens=smp.max_new - smp.n_generated,
                                     lora=self.lora is not None)
                        for item, smp in zip(answer_items(answer, job), job.samples)]
        except ServerUnavailable as e:
            self.fleet.release(job)
            if self._stop.is_set():  # closing: close() returns the samples as 'abort'
                with self._cv:
                    for smp in job.samples:
                        self._finish(smp, "abort")
                return
            self.fleet.mark_down(s, str(e))
            self._reroute(job, str(e))
            self._abort_on_server(job)  # in case it is only slow: do not leave the work there
            return
        except HTTPError as e:
            if e.status >= 500:  # the server's fault: another server may serve it
                self.fleet.release(job)
                with self._cv:
                    s.counts["errors"] += 1
                log.warning("%s; sending %s elsewhere", e, job.name)
                self._reroute(job, str(e))
                return
            error = f"server {s.url} rejected it (HTTP {e.status}): {e.message}"
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            error = f"malformed answer from {s.url}: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - never lose a request to a client bug
            log.exception("request %s failed in the client", job.name)
            error = f"client error: {type(e).__name__}: {e}"
        self.fleet.release(job)
        with self._cv:
            s.counts["requests"] += 1
            if error is not None:
                s.counts["errors"] += 1
                self._fail(job, error)
                return
            for smp, seg in zip(job.samples, segments):
                self._on_segment(smp, seg, s)

    def _reroute(self, job: Job, why: str) -> None:
        with self._cv:
            live = [smp for smp in job.samples if not smp.done]
            if not live:
                return
            job.reroutes += 1
            self._stats.totals["rerouted_requests"] += 1
            if job.reroutes > max(self.config.max_retries, len(self.fleet.servers)):
                log.error("giving up on %s after %d servers failed it (last: %s); its samples "
                          "return with finish reason 'abort'", job.name, job.reroutes, why)
                for smp in live:
                    self._stats.totals["failed_samples"] += 1
                    self._finish(smp, "abort")
                return
            self._enqueue(Job(live, self._name(live[0].request.request_id), job.reroutes))

    def _fail(self, job: Job, error: str) -> None:  # holds _cv
        rid = job.samples[0].request.request_id
        self._stats.totals["request_errors"] += 1
        self._failures[rid] = f"request {rid!r}: {error}"
        for smp in job.samples:
            smp.done = True
        self._live.pop(rid, None)
        self._aborted.discard(rid)
        self._cv.notify_all()

    # ------------------------------------------------------------------ answers

    def _on_segment(self, smp: Sample, seg: dict, server: Server) -> None:  # holds _cv
        if smp.done:
            return
        c = len(seg["tokens"])
        if c:
            if smp.start_version is None:
                smp.start_version = int(seg["versions"][0])
            for key in ("tokens", "logps", "versions", "kv_versions"):
                getattr(smp, key).append(seg[key])
        if not seg["exact"]:
            self._stats.totals["inexact_provenance_segments"] += 1
            smp.inexact = True
        self._stats.add(tokens=c)
        server.counts["tokens"] += c
        reason = seg["reason"]
        rid = smp.request.request_id
        if reason != "abort" or rid in self._aborted or self._closed:
            self._finish(smp, reason)
            return
        self._stats.totals["server_aborted_segments"] += 1
        room = min(smp.max_new - smp.n_generated,
                   self.max_seq_len - len(smp.prompt) - smp.n_generated)
        if self.config.on_abort == "resubmit" and smp.resubmits < self.config.max_resubmits \
                and room > 0:
            smp.resubmits += 1
            self._stats.totals["resubmitted_samples"] += 1
            self._enqueue(Job([smp], self._name(rid)))
        else:
            self._stats.totals["dropped_aborted_samples"] += 1
            self._finish(smp, "abort")

    def _finish(self, smp: Sample, reason: str) -> None:  # holds _cv
        if smp.done:
            return
        smp.done = True
        rid = smp.request.request_id
        start = smp.start_version if smp.start_version is not None else self.fleet.version
        self._outbox.append(completion_from_chunks(
            smp.request, smp.index, smp.prompt, smp.tokens, smp.logps, smp.versions,
            smp.kv_versions, finish_reason=reason, start_version=start,
            engine_id=self.engine_id, submit_time=smp.submit_time,
            start_time=smp.start_time or time.time()))
        if smp.inexact:
            self._stats.totals["inexact_provenance_samples"] += 1
        self._stats.totals["completed_samples"] += 1
        left = [s for s in self._live.get(rid, []) if not s.done]
        if not left:
            self._live.pop(rid, None)
            self._aborted.discard(rid)
        self._cv.notify_all()

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        """Stops sending requests and pauses every server (requests stay on them)."""
        self.fleet.pause()

    def resume(self) -> None:
        self.fleet.resume()

    def update_weights(self, weights: Any, version: int, *, wait: bool = True,
                       timeout: Optional[float] = None, allow_older: bool = False) -> None:
        """Refits every server to `weights`: a `WeightVersion` (refused unless it is what the
        engine serves), a directory, or arrays (written to `weights_dir/v{version:08d}`
        first, by `weight_sink.write_weight_version`: an HF checkpoint, for LoRA a PEFT
        adapter directory). See `InferenceEngine.update_weights`; `allow_older` permits going back to an
        older version (lag injection)."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"update_weights: version must be an integer, got {version!r}")
        version = int(version)
        self.fleet.check_newer(version, allow_older)
        path = self._weights_path(weights, version)
        self.fleet.refit(path, version, wait=wait, timeout=timeout, allow_older=allow_older)

    def _weights_path(self, weights: Any, version: int) -> str:
        if isinstance(weights, WeightVersion):
            check_receivable(self.serves, weights)
            weights = weights.path if weights.path is not None else weights.tensors
        if isinstance(weights, (str, os.PathLike)):
            # Read by the servers, on their hosts: a shared file system, same path everywhere.
            return os.path.abspath(os.fspath(weights))
        if not self.weights_dir or self.model_config is None:
            raise ValueError("update_weights: arrays need SGLangEngine(weights_dir=..., "
                             "model_config=...) to be written as an HF directory; pass a "
                             "checkpoint directory instead")
        # Appears atomically (a server never loads half a version); an older copy is replaced.
        return weight_sink.write_weight_version(
            self.weights_dir, self.serves.carrying(version, tensors=weights),
            weight_sink.dir_writer(self.serves, self.model_config)).path

    def health(self) -> Dict[str, Any]:
        with self._cv:
            fleet = self.fleet.health()
            return {"ok": fleet["error"] is None and not self._closed,
                    "version": self.fleet.version, "running": not self._closed,
                    "paused": self.fleet.paused, "closed": self._closed,
                    "error": fleet["error"], "engine_id": self.engine_id,
                    "servers_up": fleet["servers_up"], "servers_down": fleet["servers_down"],
                    "refit_errors": fleet["refit_errors"]}

    def stats(self) -> Dict[str, Any]:
        with self._cv:
            now = time.perf_counter()
            occupancy, _ = self.fleet.roll_window(now)
            w, span = self._stats.roll(now)
            w.update(occupancy)
            c, f = self._stats.totals, self.fleet.stats()
            capacity = self.fleet.capacity()
            out = {
                "engine_id": self.engine_id, "version": self.fleet.version,
                "num_slots": capacity, "active_slots": self.fleet.in_flight,
                "queued_samples": sum(len(j.samples) for j in self._pending),
                "queued_requests": len(self._pending),
                # averages over the window since the previous stats() call
                **window_rates(w, span),
                "slot_occupancy": min(w["slot_s"] / (span * capacity), 1.0) if capacity else 0.0,
                "window_decode_steps": 0,  # SGLang does not report its decode steps
                # totals
                "generated_tokens": c["tokens"], "completed_samples": c["completed_samples"],
                "refits": f["refits"], "last_refit_s": f["last_refit_s"],
                "refit_failures": f["refit_failures"], "deferred_refits": f["deferred_refits"],
                "refits_superseded": f["refits_superseded"],
                "retries": f["retries"],
                "rerouted_requests": c["rerouted_requests"],
                "request_errors": c["request_errors"],
                "server_aborted_segments": c["server_aborted_segments"],
                "resubmitted_samples": c["resubmitted_samples"],
                "dropped_aborted_samples": c["dropped_aborted_samples"],
                "failed_samples": c["failed_samples"],
                "inexact_provenance_samples": c["inexact_provenance_samples"],
                "servers_up": f["servers_up"], "servers_down": f["servers_down"],
                "servers": f["servers"],
            }
            return out

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._cv.notify_all()
            running = self.fleet.running_jobs()
            queued = list(self._pending)
            self._pending.clear()
            for j in queued:
                for smp in j.samples:
                    self._finish(smp, "abort")
        for j in running:  # the servers answer them (finish reason 'abort', partial tokens)
            self._abort_on_server(j)
        with self._cv:
            deadline = time.monotonic() + min(5.0, self.config.control_timeout_s)
            while self.fleet.running_jobs() and time.monotonic() < deadline:
                self._cv.wait(0.1)
            for j in self.fleet.running_jobs():
                for smp in j.samples:
                    self._finish(smp, "abort")
        self.fleet.close_clients()
        self._executor.shutdown(wait=False, cancel_futures=True)


def make_sglang_engine(cfg, init_checkpoint: str, index: int, workdir: str) -> SGLangEngine:
    """The engine of rollout worker `index`: servers `urls[index::num_workers]`, version -1
    (no usable weights until the learner's first version is installed). `init_checkpoint` is
    only described (`describe_run`: LoRA adapters are of its base); the servers were
    launched with their own copy."""
    validate_sglang_config(cfg.sglang, "sglang", required=True,
                           num_workers=cfg.rollout.num_workers)
    urls = tuple(cfg.sglang.urls)[index::cfg.rollout.num_workers]
    model_cfg = resolve_model_config(cfg.model, get_tokenizer(cfg.tokenizer).vocab_size)
    return SGLangEngine(urls, cfg.sglang, vocab_size=model_cfg.vocab_size,
                        max_seq_len=cfg.sglang.max_seq_len, version=-1,
                        engine_id=f"sglang-{index}",
                        weights_dir=weight_sink.weights_dir(cfg, workdir), model_config=model_cfg,
                        require_refit=True, serves=describe_run(cfg, init_checkpoint))
