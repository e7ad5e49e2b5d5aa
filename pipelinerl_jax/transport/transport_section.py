"""The `transport` config section and its validation (one message naming the key).

    t = cfg.transport = transport_config()
    validate_transport_config(t, "transport")
    server = RolloutQueueServer.from_config(t)                     # queue process
    client = RolloutQueueClient(queue_address(t), **client_kwargs(t))   # workers, learner
    publisher = WeightPublisher(weights_address(t), **publisher_kwargs(t))         # learner
    subscriber = WeightSubscriber(weights_address(t), on_weights, **subscriber_kwargs(t))
"""
from __future__ import annotations

import os
from typing import Optional

from ml_collections import ConfigDict, config_dict

from pipelinerl_jax.config_checks import ConfigError, check_keys, get, number, one_of, positive_int
from pipelinerl_jax.transport.codec import Limits
from pipelinerl_jax.transport.queue_core import STALE_POLICIES
from pipelinerl_jax.transport.security import TLSConfig, check_bind, load_token
from pipelinerl_jax.transport.weights import PAYLOADS

_MIB = 1 << 20


def transport_config() -> ConfigDict:
    c = ConfigDict()
    c.host = "127.0.0.1"             # bind + dial host of both services; loopback by default
    # Roles on separate machines: the queue's and the learner's (weight stream) host, each
    # the address its server binds and its clients dial; None = `host`.
    c.queue_host = config_dict.placeholder(str)
    c.weights_host = config_dict.placeholder(str)
    c.queue_port = 50051
    c.weights_port = 50052
    c.allow_insecure_remote = False  # permit a non-loopback host without token or TLS
    # RolloutQueue
    c.capacity_rollouts = 4096       # pending + ready + delivered-but-unacked rollouts
    c.capacity_bytes = 1 << 30
    c.max_lag = config_dict.placeholder(int)  # None: no staleness policy
    c.stale_policy = "drop"          # 'drop' | 'keep' (keep = deliver and count)
    c.incomplete_group_timeout_s = 600.0
    c.max_hold_s = 5.0               # how long a full queue holds a put before refusing it
    c.vocab_size = 0                 # 0: token ids only checked >= 0
    c.max_prompt_tokens = 65536
    c.max_completion_tokens = 65536
    c.max_group_size = 1024
    c.max_message_bytes = 64 * _MIB  # gRPC send/receive limit on both sides of the queue
    # Weight sync
    c.weight_chunk_bytes = 4 * _MIB
    c.weight_checksum = True         # crc32 per chunk, verified before on_weights
    # 'grpc': the payload as chunk frames on the stream; 'socket': on a ticketed plain TCP
    # connection beside it (no frame assembly, no gRPC copies; plaintext: not with TLS)
    c.weight_payload = "grpc"
    c.weight_payload_port = 0        # 'socket': its listener's port (0: any free one)
    # Security
    c.auth_token = config_dict.placeholder(str)
    c.auth_token_file = config_dict.placeholder(str)
    c.tls_cert_file = config_dict.placeholder(str)  # server side
    c.tls_key_file = config_dict.placeholder(str)
    c.tls_ca_file = config_dict.placeholder(str)    # client side
    c.tls_server_name = config_dict.placeholder(str)
    return c


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _checked(prefix: str, fn, cfg, name: str, *args, **kwargs):
    """Runs a `pipelinerl_jax.config_checks` check on `cfg[name]`, naming `prefix.name` on failure."""
    try:
        return fn(cfg, name, *args, **kwargs)
    except ConfigError as e:
        raise ConfigError(_key(prefix, name), str(e).split(": ", 1)[1]) from None


def validate_transport_config(cfg, prefix: str = "transport") -> None:
    """Raises ConfigError naming the first bad key of a `transport_config()` section."""
    defaults = transport_config()
    check_keys(cfg, prefix, defaults.keys())
    k = lambda name: _key(prefix, name)  # noqa: E731
    v = {name: _checked(prefix, get, cfg, name) for name in defaults.keys()}
    if not isinstance(v["host"], str) or not v["host"]:
        raise ConfigError(k("host"), f"must be a non-empty host name or IP, got {v['host']!r}")
    for name in ("queue_host", "weights_host"):
        if v[name] is not None and (not isinstance(v[name], str) or not v[name]):
            raise ConfigError(k(name), f"must be a host name or IP, or None, got {v[name]!r}")
    for name in ("queue_port", "weights_port", "weight_payload_port"):
        if _checked(prefix, positive_int, cfg, name, allow_zero=True) > 65535:
            raise ConfigError(k(name), f"must be in [0, 65535], got {v[name]}")
    for name in ("capacity_rollouts", "capacity_bytes", "max_prompt_tokens",
                 "max_completion_tokens", "max_group_size"):
        _checked(prefix, positive_int, cfg, name)
    _checked(prefix, positive_int, cfg, "vocab_size", allow_zero=True)
    if v["max_lag"] is not None:
        _checked(prefix, positive_int, cfg, "max_lag", allow_zero=True)
    _checked(prefix, one_of, cfg, "stale_policy", STALE_POLICIES)
    _checked(prefix, number, cfg, "incomplete_group_timeout_s", lo=0, lo_open=True)
    _checked(prefix, number, cfg, "max_hold_s", lo=0)
    if v["max_group_size"] > v["capacity_rollouts"]:
        raise ConfigError(k("max_group_size"), f"{v['max_group_size']} exceeds "
                                               f"capacity_rollouts={v['capacity_rollouts']}")
    if _checked(prefix, positive_int, cfg, "max_message_bytes") < _MIB:
        raise ConfigError(k("max_message_bytes"), f"must be >= 1 MiB, got {v['max_message_bytes']}")
    chunk = _checked(prefix, positive_int, cfg, "weight_chunk_bytes")
    if not 1024 <= chunk <= 256 * _MIB:
        raise ConfigError(k("weight_chunk_bytes"), f"must be in [1024, 256 MiB], got {chunk}")
    for name in ("weight_checksum", "allow_insecure_remote"):
        if not isinstance(v[name], bool):
            raise ConfigError(k(name), f"must be True or False, got {v[name]!r}")
    _checked(prefix, one_of, cfg, "weight_payload", PAYLOADS)
    if v["weight_payload"] == "socket" and (v["tls_cert_file"] or v["tls_ca_file"]):
        raise ConfigError(k("weight_payload"), "'socket' sends the weights in plaintext and "
                          "cannot be combined with TLS (tls_*): use 'grpc'")
    if v["weight_payload_port"] and v["weight_payload_port"] == v["weights_port"]:
        raise ConfigError(k("weight_payload_port"), f"{v['weight_payload_port']} is also "
                          "weights_port: the payload listener needs a port of its own")
    if v["auth_token"] and v["auth_token_file"]:
        raise ConfigError(k("auth_token"), "set auth_token or auth_token_file, not both")
    for name in ("auth_token_file", "tls_cert_file", "tls_key_file", "tls_ca_file"):
        if v[name] is not None and not os.path.isfile(v[name]):
            raise ConfigError(k(name), f"file {v[name]!r} does not exist")
    if bool(v["tls_cert_file"]) != bool(v["tls_key_file"]):
        raise ConfigError(k("tls_key_file" if v["tls_cert_file"] else "tls_cert_file"),
                          "tls_cert_file and tls_key_file must be set together")
    for name in ("auth_token", "auth_token_file"):
        if v[name]:
            try:  # the same reading the servers and clients do
                load_token(**{name.replace("auth_", ""): v[name]})
            except (OSError, ValueError) as e:
                raise ConfigError(k(name), str(e)) from None
    secured = bool(v["auth_token"] or v["auth_token_file"] or v["tls_cert_file"])
    for name in ("host", "queue_host", "weights_host"):
        if v[name] is None:
            continue
        try:
            check_bind(v[name], secured, v["allow_insecure_remote"])
        except ValueError:
            raise ConfigError(k(name), f"{v[name]!r} is not a loopback address and neither a "
                              "token nor TLS is configured; set auth_token(_file) or tls_* or "
                              "allow_insecure_remote=True") from None


# ------------------------------------------------------------------------- helpers

def limits_from_config(cfg) -> Limits:
    return Limits(vocab_size=cfg.vocab_size, max_prompt_tokens=cfg.max_prompt_tokens,
                  max_completion_tokens=cfg.max_completion_tokens,
                  max_group_size=cfg.max_group_size)


def tls_from_config(cfg, server: bool) -> Optional[TLSConfig]:
    if server:
        if not cfg.tls_cert_file:
            return None
        return TLSConfig(cert_file=cfg.tls_cert_file, key_file=cfg.tls_key_file)
    if not cfg.tls_ca_file:
        return None
    return TLSConfig(ca_file=cfg.tls_ca_file, server_name=cfg.tls_server_name)


def queue_address(cfg) -> str:
    return f"{cfg.get('queue_host') or cfg.host}:{cfg.queue_port}"


def weights_address(cfg) -> str:
    return f"{cfg.get('weights_host') or cfg.host}:{cfg.weights_port}"


def client_kwargs(cfg) -> dict:
    """Keyword arguments of RolloutQueueClient from the section (token, tls, message limit)."""
    return {"token": load_token(cfg.auth_token, cfg.auth_token_file),
            "tls": tls_from_config(cfg, server=False),
            "max_message_bytes": cfg.max_message_bytes}


def subscriber_kwargs(cfg) -> dict:
    """Keyword arguments of WeightSubscriber from the section."""
    return {"token": load_token(cfg.auth_token, cfg.auth_token_file),
            "tls": tls_from_config(cfg, server=False),
            "max_message_bytes": cfg.weight_chunk_bytes + _MIB}


def publisher_kwargs(cfg) -> dict:
    """Keyword arguments of WeightPublisher (after its bind address) from the section."""
    return {"token": load_token(cfg.auth_token, cfg.auth_token_file),
            "tls": tls_from_config(cfg, server=True), "chunk_bytes": cfg.weight_chunk_bytes,
            "checksum": cfg.weight_checksum, "payload": cfg.get("weight_payload", "grpc"),
            "payload_port": cfg.get("weight_payload_port", 0)}
