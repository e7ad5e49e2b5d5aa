"""A small JSON-over-HTTP client for one SGLang server: keep-alive, retries, clear errors.

Why the standard library (`http.client`) and threads rather than asyncio + httpx/aiohttp:
a rollout worker holds at most `concurrency_per_server × servers` requests in flight (tens
to a few hundred), each lasting seconds of GPU generation; a blocked thread per request costs
little next to that, releases the GIL while it waits on its socket, and keeps the engine free
of an event loop and of a new dependency. `scripts/bench_sglang_client.py` measures what this
client sustains (requests/s, CPU per request). urllib3's pooled client (retries included)
costs more client CPU per request than this one (0.99 ms against 0.60 ms: BENCHMARKS.md,
"Hand-written or a library"), so it does not replace it.

Each thread keeps one persistent connection per server (HTTP/1.1 keep-alive). A reused
connection the server closed while idle (uvicorn drops idle ones after a few seconds) is
reopened and the request resent once, without counting as a failure.

Retries (`RetryPolicy`, exponential backoff with jitter): connection errors, timeouts and
the statuses SGLang uses for "not now" (502/503/504, e.g. /health while starting) are retried
up to `max_retries` times; then `ServerUnavailable` is raised. Any other non-2xx raises
`HTTPError` carrying the server's own message (SGLang answers errors as
`{"error": {"message": ...}}`, validation errors as `{"message": ...}`, control endpoints as
`{"success": false, "message": ...}`, LoRA loads and unloads as `{"success": false,
"error_message": ...}`: `io_struct.LoRAUpdateOutput`).
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from typing import Any, Optional, Tuple

from pipelinerl_jax.transport.retry import RetryPolicy

RETRY_STATUSES = (502, 503, 504)
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          http.client.BadStatusLine)


class HTTPError(Exception):
    """A non-retryable HTTP status; `message` is the server's explanation."""

    def __init__(self, url: str, path: str, status: int, message: str):
        self.url, self.path, self.status, self.message = url, path, status, message
        super().__init__(f"{url}{path}: HTTP {status}: {message}")


class ServerUnavailable(Exception):
    """The server did not answer usefully within the retry budget (down, starting, stuck)."""


def error_message(body: bytes) -> str:
    """The human-readable message of an SGLang error body (falls back to the raw text)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:2000] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "error_message", "detail", "error"):
            if obj.get(key):
                return str(obj[key])
    return text[:2000]


def parse_url(url: str) -> Tuple[str, int]:
    """'http://host:port' -> (host, port); raises ValueError naming what is wrong."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.path not in ("", "/") or u.query:
        raise ValueError(f"{url!r} is not of the form http://host:port")
    try:
        port = u.port or 80
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port") from None
    return u.hostname, port


class ServerClient:
    """JSON requests to one server. Thread-safe: every thread has its own connection."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0, max_retries: int = 5,
                 retry: RetryPolicy = RetryPolicy(0.1, 5.0), api_key: str = ""):
        self.url = url.rstrip("/")
        self.host, self.port = parse_url(self.url)
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.retry = retry
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set = set()  # every thread's connection, so close() can reach them
        self.retries = 0  # retried attempts (503s, connection errors, timeouts)

    # ------------------------------------------------------------------ connections

    def _connection(self, timeout: Optional[float]) -> Tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        fresh = conn is None
        if fresh:
            conn = http.client.HTTPConnection(self.host, self.port,
                                              timeout=self.connect_timeout_s)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        conn.sock.settimeout(timeout)  # None = block until the (long) generation answers
        return conn, fresh

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def close(self) -> None:
        """Shuts every open connection: threads blocked on an answer get an error now."""
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _once(self, method: str, path: str, payload: Optional[bytes],
              timeout: Optional[float]) -> Tuple[int, bytes]:
        for reuse_attempt in range(2):
            conn, fresh = self._connection(timeout)
            try:
                conn.request(method, path, body=payload, headers=self._headers)
                resp = conn.getresponse()
                body = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self._drop_connection()
                return resp.status, body
            except _STALE:
                self._drop_connection()
                if fresh or reuse_attempt:
                    raise
            except BaseException:
                self._drop_connection()
                raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ requests

    def request(self, method: str, path: str, body: Any = None, *,
                timeout: Optional[float] = 60.0, retries: Optional[int] = None,
                stop: Optional[threading.Event] = None) -> Any:
        """Sends `body` as JSON; returns the decoded JSON answer (None for an empty 200).

        Raises `HTTPError` for a non-retryable status and `ServerUnavailable` once
        `retries` (default `max_retries`) retried attempts failed. `stop` ends the retry
        loop early (engine shutdown).
        """
        payload = None if body is None else json.dumps(body).encode()
        retries = self.max_retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
                delay = self.retry.delay(attempt - 1)
                if stop is not None:
                    if stop.wait(delay):
                        break
                else:
                    time.sleep(delay)
            try:
                status, raw = self._once(method, path, payload, timeout)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
                last = f"{type(e).__name__}: {e}"
                continue
            if status in RETRY_STATUSES:
                last = f"HTTP {status}: {error_message(raw)}"
                self._drop_connection()  # the next try may reach a healthier backend
                continue
            if not 200 <= status < 300:
                raise HTTPError(self.url, path, status, error_message(raw))
            if not raw.strip():
                return None
            try:
                return json.loads(raw)
            except ValueError:
                raise HTTPError(self.url, path, status,
                                f"answer is not JSON: {raw[:200]!r}") from None
        raise ServerUnavailable(f"{self.url}{path}: no answer after {retries + 1} attempts "
                                f"(last: {last or 'stopped'})")

    def get(self, path: str, **kw) -> Any:
        return self.request("GET", path, None, **kw)

    def post(self, path: str, body: Any = None, **kw) -> Any:
        return self.request("POST", path, {} if body is None else body, **kw)

    def healthy(self, timeout: float = 5.0) -> bool:
        """One `/health` probe (no retries): True on 200."""
        try:
            self.request("GET", "/health", None, timeout=timeout, retries=0)
            return True
        except (HTTPError, ServerUnavailable):
            return False


# ---------------------------------------------------------------------------- capabilities

# What refitting a server takes (`SGLangEngine.update_weights`): pause, load, continue.
REFIT_ENDPOINTS = ("/pause_generation", "/update_weights_from_disk", "/continue_generation")


class MissingEndpointError(RuntimeError):
    """A server lacks an endpoint the configuration needs (found at start-up, not mid-run)."""


def missing_endpoints(client: ServerClient, paths=REFIT_ENDPOINTS,
                      timeout: float = 10.0) -> list:
    """The POST endpoints among `paths` that `client`'s server does not serve, probed once
    each with a GET, which changes nothing: SGLang's FastAPI app answers 405 for a POST-only
    route and 404 for a path it does not have (sglang-jax 0.1.0rc0: /update_weights_from_disk).
    Only a 404 counts as missing; an unreachable server raises `ServerUnavailable`."""
    out = []
    for path in paths:
        try:
            client.request("GET", path, None, timeout=timeout, retries=1)
        except HTTPError as e:
            if e.status == 404:
                out.append(path)
    return out


# What publishing LoRA adapters to a server takes (`SGLangEngine(lora=...)`).
LORA_ENDPOINTS = ("/load_lora_adapter", "/unload_lora_adapter")
REFIT_HINT = ("sglang-jax has no weight-update endpoint: sample with the embedded engine "
              "(sampler.kind='jax') or from SGLang servers that have it")
LORA_HINT = ("sglang-jax serves LoRA adapters only from --lora-paths given at launch (merged "
             "statically; no /load_lora_adapter), so it cannot take a new adapter every "
             "version: with lora.enabled sample with the embedded engine (sampler.kind='jax') "
             "or from SGLang servers launched with --enable-lora")


def require_endpoints(clients, paths=REFIT_ENDPOINTS, why: str = "refits them",
                      hint: str = REFIT_HINT) -> None:
    """Raises `MissingEndpointError` naming every server and endpoint it lacks (one probe
    each, `missing_endpoints`), then `hint`; servers that do not answer are left to the
    caller."""
    gaps = []
    for c in clients:
        try:
            gaps += [f"{c.url} has no {p}" for p in missing_endpoints(c, paths)]
        except ServerUnavailable:
            continue
    if gaps:
        raise MissingEndpointError(
            f"SGLang server(s) cannot serve this configuration, which {why}: {'; '.join(gaps)} "
            f"(HTTP 404). {hint}")


def require_lora_server(clients, rank: int, targets, timeout: float = 10.0) -> None:
    """Raises `MissingEndpointError` unless every server (that answers) was launched to take
    adapters of `rank` on `targets`: `/get_server_info` reports SGLang's server args
    (`server_args.py`): `enable_lora`, `max_lora_rank`, `lora_target_modules` ('all' or a
    list). A load outside them would fail at the first version (`lora_manager`
    `validate_new_adapter`: rank above `--max-lora-rank`, or a module outside
    `--lora-target-modules`); this says so at start-up."""
    gaps = []
    for c in clients:
        try:
            info = c.get("/get_server_info", timeout=timeout, retries=1) or {}
        except (HTTPError, ServerUnavailable):
            continue
        if "enable_lora" in info and not info["enable_lora"]:  # (absent: not reported)
            gaps.append(f"{c.url} was not launched with --enable-lora")
            continue
        max_rank = info.get("max_lora_rank")
        if isinstance(max_rank, int) and max_rank < rank:
            gaps.append(f"{c.url} has --max-lora-rank {max_rank} < lora.rank {rank}")
        served = info.get("lora_target_modules")
        if isinstance(served, str):
            served = [served]
        if served and "all" not in served:
            missing = sorted(set(targets) - set(served))
            if missing:
                gaps.append(f"{c.url} has --lora-target-modules {sorted(served)}, without "
                            f"{missing}")
    if gaps:
        raise MissingEndpointError(
            f"SGLang server(s) cannot take this run's LoRA adapters (rank {rank}, targets "
            f"{list(targets)}): {'; '.join(gaps)}. Launch them with --enable-lora "
            f"--max-lora-rank {rank} --lora-target-modules {' '.join(targets)}")
