"""Shared helpers for the transport tests (also the targets of spawned processes)."""
from __future__ import annotations

import datetime
import ipaddress
import os
import time

import numpy as np

from pipelinerl_jax import records


class HandlerContext:
    """The parts of `grpc.ServicerContext` the queue's handlers use, for calling
    `RolloutQueueServer.handlers` in-process: `abort` raises `Aborted(code, details)` as
    gRPC's raises its own exception; trailing metadata is recorded."""

    class Aborted(Exception):
        @property
        def code(self):
            return self.args[0]

        @property
        def details(self):
            return self.args[1]

    def __init__(self):
        self.trailing = ()

    def abort(self, code, details):
        raise self.Aborted(code, details)

    def is_active(self):
        return True

    def set_trailing_metadata(self, md):
        self.trailing = md


def make_rollout(group_id: str = "g", group_size: int = 1, completion: int = 6,
                 prompt: int = 3, version: int = 0, member: int = 0,
                 producer: int = 0) -> records.Rollout:
    """A valid rollout; `member`/`producer` are recorded in metrics to identify it later."""
    return records.Rollout(
        prompt_ids=np.arange(1, prompt + 1, dtype=np.int32),
        completion_ids=(np.arange(completion, dtype=np.int32) * 7) % 100,
        logp_behaviour=-np.linspace(0.1, 2.0, completion).astype(np.float32),
        version=np.full(completion, version, np.int32),
        kv_version=np.full(completion, version, np.int32),
        reward=1.0, advantage=0.5, group_id=group_id, group_size=group_size,
        task_id="t", finish_reason="stop", start_version=version, engine_id="e0",
        submit_time=1.0, start_time=2.0, finish_time=3.0,
        metrics={"member": float(member), "producer": float(producer)})


def make_group(group_id: str, size: int, version: int = 0, producer: int = 0,
               completion: int = 6) -> list:
    return [make_rollout(group_id, size, completion=completion, version=version, member=i,
                         producer=producer) for i in range(size)]


def producer_main(address: str, producer: int, num_groups: int, group_size: int,
                  split_every: int, out_q, hold_s: float = 1.0, completion: int = 6) -> None:
    """Puts `num_groups` groups; every `split_every`-th group goes in two pieces with another
    group's put in between. Reports the client's retry counts."""
    from pipelinerl_jax.transport.queue_client import RolloutQueueClient
    from pipelinerl_jax.transport.retry import RetryPolicy
    client = RolloutQueueClient(address, hold_s=hold_s,
                                retry=RetryPolicy(initial_s=0.005, max_s=0.05))
    client.wait_ready(30)
    held_back = None
    for g in range(num_groups):
        group = make_group(f"p{producer}-g{g}", group_size, producer=producer,
                           completion=completion)
        if split_every and g % split_every == 0 and group_size > 1:
            client.put(group[:1])           # first piece now ...
            held_back = group[1:]           # ... the rest after the next group
            continue
        client.put_group(group)
        if held_back is not None:
            client.put(held_back)
            held_back = None
    if held_back is not None:
        client.put(held_back)
    out_q.put((producer, dict(client.retry_counts)))
    client.close()


def publisher_main(conn, chunk_bytes: int, address: str = "127.0.0.1:0") -> None:
    """A weight publisher process driven over a pipe: ("publish", version, n) publishes n
    float32 values filled with the version; the process is meant to be SIGKILLed."""
    from tests.transport.flat_weights import FlatPublisher as WeightPublisher
    pub = WeightPublisher(address, chunk_bytes=chunk_bytes)
    conn.send(pub.port)
    while True:
        cmd, version, n = conn.recv()
        params = {f"w{i}": np.full(n // 4, version, np.float32) for i in range(4)}
        pub.publish(version, params)
        conn.send(time.monotonic())


def self_signed_pair(directory: str, host: str = "localhost") -> tuple[str, str]:
    """Writes a self-signed certificate (for `host` and 127.0.0.1) and its key; returns paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def eventually(condition, timeout: float = 10.0) -> bool:
    """Polls `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
