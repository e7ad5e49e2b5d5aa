"""Plumbing shared by the queue and weight services: auth, TLS, size limits.

Defaults are safe for one machine: servers bind 127.0.0.1 unless an address is given, and
`check_bind` refuses a non-loopback bind without a token or TLS (the config validation and
the standalone server both call it).
- Auth: an optional shared token. Clients send metadata `authorization: Bearer <token>` on
  every call; a server interceptor compares SHA-256 digests of what it got and what it
  expects with `hmac.compare_digest` (constant time, whatever the lengths) and answers
  anything else with UNAUTHENTICATED before the handler runs.
- Token files are read by `load_token`, by servers and clients alike: the token is the
  file's first line without surrounding whitespace; it must be 1-1024 visible ASCII
  characters (what an HTTP/2 header value carries), else a ValueError names the file.
- TLS: optional; the server presents `cert_file`/`key_file`, the client trusts `ca_file`
  (and may check the certificate against `server_name` instead of the dialled host).
- Message sizes are always set explicitly on both sides (gRPC's implicit 4 MiB receive limit
  would otherwise decide for us).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
from concurrent import futures
from typing import Optional, Sequence

import grpc

DEFAULT_HOST = "127.0.0.1"
_AUTH_KEY = "authorization"
MAX_TOKEN_CHARS = 1024  # gRPC refuses metadata past 8-16 KiB; a token needs far less


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """PEM file paths. A server needs cert_file + key_file; a client needs ca_file."""
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    ca_file: Optional[str] = None
    server_name: Optional[str] = None  # client: name to verify instead of the dialled host


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_token(token: str, source: str = "token") -> str:
    """`token` if it can travel as `authorization: Bearer <token>`; ValueError otherwise."""
    if not token:
        raise ValueError(f"{source}: the token is empty")
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"{source}: the token is longer than {MAX_TOKEN_CHARS} characters")
    bad = next((c for c in token if not "\x21" <= c <= "\x7e"), None)
    if bad is not None:
        raise ValueError(f"{source}: the token holds the character {bad!r}; only visible "
                         "ASCII characters (no spaces) are allowed")
    return token


def load_token(token: Optional[str] = None, token_file: Optional[str] = None) -> Optional[str]:
    """The shared token from a value or a file; None = auth off.

    A file's token is its first line, stripped of surrounding whitespace (later lines are
    ignored: room for a comment). Either way the token is checked by `check_token`."""
    if token:
        return check_token(token)
    if token_file:
        with open(token_file, "rb") as f:
            first = f.readline(MAX_TOKEN_CHARS + 2)  # never reads a huge file whole
        try:
            line = first.decode("ascii").strip()
        except UnicodeDecodeError:
            raise ValueError(f"token file {token_file}: the first line is not ASCII") from None
        if not line:
            raise ValueError(f"token file {token_file}: the first line is empty")
        return check_token(line, f"token file {token_file}")
    return None


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IPs (v4 or v6, bracketed or not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secured: bool, allow_insecure_remote: bool = False) -> None:
    """Refuses (ValueError) a non-loopback `host` unless a token or TLS secures it."""
    if not is_loopback(host) and not secured and not allow_insecure_remote:
        raise ValueError(f"{host!r} is not a loopback address and neither a token nor TLS "
                         "is configured; set a token or TLS, or allow insecure remote "
                         "access explicitly")


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
        self._expected = hashlib.sha256(f"Bearer {token}".encode()).digest()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        got = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == _AUTH_KEY:
                got = value.encode() if isinstance(value, str) else value
        # Digests: equal lengths, so the comparison time says nothing about the token.
        if hmac.compare_digest(hashlib.sha256(got).digest(), self._expected):
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


def address_host(address: str) -> str:
    """The host part of "host:port" ("[::1]:0" -> "::1"; an address without a port is a host)."""
    return (address.rsplit(":", 1)[0] if ":" in address else address).strip("[]")


def host_port(address: str, port: int) -> str:
    """`address` with its port replaced by the bound one ("127.0.0.1:0" -> "127.0.0.1:4321")."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return f"{host}:{port}"
