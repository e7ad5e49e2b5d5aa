"""The weight payload off gRPC (`WeightPublisher(payload="socket")`, docs/transport.md).

The publisher's stream carries a version's header with this listener's port and a one-time
ticket; the subscriber connects to the host it dialled, sends the ticket and reads the bytes.
This module is the socket half: `PayloadListener` (publisher side: tickets, one short-lived
thread per connection, hostile clients counted and survived) and `open_payload` (subscriber
side). What is sent is the version's business: a claim holds an object with
`send_payload(conn)` (weights._Version sends from the tensors' own memory).
"""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

TICKET_BYTES = 32


class Claim:
    """One stream's claim on one version's payload; `done` is set once it was sent (`ok`)
    or failed."""

    def __init__(self, version):
        self.version, self.done, self.ok = version, threading.Event(), False


class PayloadListener:
    """A TCP listener on `host` (`port`; 0: an ephemeral one) that sends a claimed version's payload to
    whoever presents its ticket, once. `timeout` bounds the wait for a ticket and each send;
    at most `max_connections` are served at once (more are refused and counted). Nothing a
    client does ends it; `stop()` does."""

    def __init__(self, host: str, timeout: float, max_connections: int, name: str = "",
                 port: int = 0):
        self.timeout = timeout
        self.sent = self.refused = self.errors = 0  # observability
        self._lock = threading.Lock()
        self._tickets: dict[bytes, Claim] = {}
        self._conns: set = set()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopped = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(e.errno, f"the weight payload listener cannot bind {host}:{port}: "
                                   f"{e.strerror}") from e
        self._sock.listen(64)
        self._sock.settimeout(0.2)  # the accept loop checks for stop()
        self.port = self._sock.getsockname()[1]
        self._name = name
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"payload-{name}")
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Tickets issued and not yet presented, revoked or expired."""
        return len(self._tickets)

    def issue(self, version) -> tuple[bytes, Claim]:
        """A fresh ticket for `version` (valid once, until `revoke`)."""
        ticket, claim = secrets.token_bytes(TICKET_BYTES), Claim(version)
        with self._lock:
            self._tickets[ticket] = claim
        return ticket, claim

    def revoke(self, ticket: bytes) -> None:
        with self._lock:
            self._tickets.pop(ticket, None)

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stopped:
                    return
                self.errors += 1
                log.warning("weight payload listener: accept failed: %r", e)
                time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                log.warning("weight payload listener: connection refused: all slots busy")
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"payload-conn-{self._name}").start()
            except Exception as e:  # noqa: BLE001 - e.g. no more threads
                self._slots.release()
                self.errors += 1
                log.warning("weight payload listener: cannot serve a connection: %r", e)
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        claim = None
        try:
            with self._lock:
                self._conns.add(conn)
            conn.settimeout(self.timeout)
            ticket = recv_exact(conn, TICKET_BYTES)
            with self._lock:
                claim = None if ticket is None else self._tickets.pop(ticket, None)
            if claim is None:
                self.refused += 1
                log.warning("weight payload listener: a connection with an unknown ticket")
                return
            claim.version.send_payload(conn)
            claim.ok = True
            self.sent += 1
        except Exception as e:  # noqa: BLE001 - a hostile or broken connection: count, go on
            self.errors += 1
            log.warning("weight payload listener: connection failed: %r", e)
        finally:
            if claim is not None:
                claim.done.set()
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            finally:
                self._slots.release()

    def stop(self) -> None:
        self._stopped = True
        self._thread.join(5)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # wakes their threads (they close it themselves)
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


def send_buffers(conn: socket.socket, buffers) -> None:
    """Sends `buffers` in order with `sendmsg` from their own memory (no join); resumes
    after partial sends. Raises OSError if the connection fails."""
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        sent = conn.sendmsg(views[i:i + _IOV_MAX])
        while sent and i < len(views):
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i], sent = views[i][sent:], 0


def open_payload(host: str, port: int, ticket: bytes, timeout: float) -> socket.socket:
    """A connection to a publisher's payload listener that has sent `ticket`."""
    conn = socket.create_connection((host, port), timeout=timeout)
    try:
        conn.sendall(ticket)
    except BaseException:
        conn.close()
        raise
    return conn


def recv_exact(conn: socket.socket, n: int) -> Optional[bytes]:
    """Exactly `n` bytes from `conn` (None if it closes first); the socket's timeout applies
    to each read."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = conn.recv_into(view[pos:], n - pos)
        if not got:
            return None
        pos += got
    return bytes(buf)
