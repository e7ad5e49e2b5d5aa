"""Plumbing shared by the queue and weight services: auth, TLS, size limits, retry backoff.

Defaults are safe for one machine: servers bind 127.0.0.1 unless an address is given.
- Auth: an optional shared token. Clients send metadata `authorization: Bearer <token>` on
  every call; a server interceptor compares it in constant time (`hmac.compare_digest`) and
  answers anything else with UNAUTHENTICATED before the handler runs.
- TLS: optional; the server presents `cert_file`/`key_file`, the client trusts `ca_file`
  (and may check the certificate against `server_name` instead of the dialled host).
- Message sizes are always set explicitly on both sides (gRPC's implicit 4 MiB receive limit
  would otherwise decide for us).
"""
from __future__ import annotations

import dataclasses
import hmac
import random
from concurrent import futures
from typing import Optional, Sequence

import grpc

DEFAULT_HOST = "127.0.0.1"
_AUTH_KEY = "authorization"


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """PEM file paths. A server needs cert_file + key_file; a client needs ca_file."""
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    ca_file: Optional[str] = None
    server_name: Optional[str] = None  # client: name to verify instead of the dialled host


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Delay before retry k: d = min(max_s, initial_s * multiplier**k), drawn from [d/2, d]."""
    initial_s: float = 0.02
    max_s: float = 2.0
    multiplier: float = 2.0

    def delay(self, attempt: int) -> float:
        d = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 30))
        return random.uniform(d / 2, d)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def load_token(token: Optional[str] = None, token_file: Optional[str] = None) -> Optional[str]:
    """The shared token from a value or a file (first line, stripped); None = auth off."""
    if token:
        return token
    if token_file:
        value = _read(token_file).decode().strip()
        if not value:
            raise ValueError(f"token file {token_file} is empty")
        return value
    return None


def grpc_options(max_message_bytes: int) -> list:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Reconnect quickly after a server restart instead of gRPC's 120 s ceiling.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000)]


def call_metadata(token: Optional[str]) -> tuple:
    return ((_AUTH_KEY, f"Bearer {token}"),) if token else ()


def _deny(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only aborts UNAUTHENTICATED."""
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose `authorization` metadata is not `Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        got = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == _AUTH_KEY:
                got = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(got, self._expected):
            return handler
        return _deny(handler, "missing or wrong bearer token" if got else
                     "missing authorization metadata (bearer token required)")


def make_server(address: str, *, max_message_bytes: int, token: Optional[str] = None,
                tls: Optional[TLSConfig] = None, max_workers: int = 32,
                handlers: Sequence[grpc.GenericRpcHandler] = ()) -> tuple[grpc.Server, int]:
    """Creates and binds (does not start) a gRPC server; returns (server, bound port)."""
    interceptors = [TokenAuthInterceptor(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=interceptors, handlers=list(handlers),
                         options=grpc_options(max_message_bytes) +
                         [("grpc.so_reuseport", 0)])
    if tls is not None:
        if not (tls.cert_file and tls.key_file):
            raise ValueError("TLS server needs cert_file and key_file")
        creds = grpc.ssl_server_credentials([(_read(tls.key_file), _read(tls.cert_file))])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port


def make_channel(address: str, *, max_message_bytes: int,
                 tls: Optional[TLSConfig] = None) -> grpc.Channel:
    options = grpc_options(max_message_bytes)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    root = _read(tls.ca_file) if tls.ca_file else None  # None: the system roots
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root), options=options)


def host_port(address: str, port: int) -> str:
    """`address` with its port replaced by the bound one ("127.0.0.1:0" -> "127.0.0.1:4321")."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return f"{host}:{port}"
