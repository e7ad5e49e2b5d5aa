"""The transport config section: defaults validate; each bad value names its key."""
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.transport.transport_section import (
    client_kwargs, transport_config, validate_transport_config)
from pipelinerl_jax.transport.queue_server import RolloutQueueServer


def test_defaults_are_valid_and_loopback():
    cfg = transport_config()
    validate_transport_config(cfg, "transport")
    assert cfg.host == "127.0.0.1"
    assert client_kwargs(cfg) == {"token": None, "tls": None, "max_message_bytes": 64 << 20}


@pytest.mark.parametrize("key,value,match", [
    ("max_lag", -1, "transport.max_lag"),
    ("stale_policy", "evict", "transport.stale_policy"),
    ("queue_port", 70000, "transport.queue_port"),
    ("capacity_rollouts", 0, "transport.capacity_rollouts"),
    ("capacity_bytes", -5, "transport.capacity_bytes"),
    ("incomplete_group_timeout_s", 0.0, "transport.incomplete_group_timeout_s"),
    ("max_group_size", 10_000, "transport.max_group_size"),
    ("max_message_bytes", 1000, "transport.max_message_bytes"),
    ("weight_chunk_bytes", 10, "transport.weight_chunk_bytes"),
    ("tls_cert_file", "/no/such/cert.pem", "transport.tls_cert_file"),
    ("auth_token_file", "/no/such/token", "transport.auth_token_file"),
    ("host", "0.0.0.0", "transport.host: '0.0.0.0' is not a loopback"),
    ("weight_checksum", "yes", "transport.weight_checksum"),
    ("weight_payload", "shm", "transport.weight_payload"),
    ("weight_payload_port", 70000, "transport.weight_payload_port"),
    ("weight_payload_port", 50052, "transport.weight_payload_port: 50052 is also weights_port"),
])
def test_bad_values_name_the_key(key, value, match):
    cfg = transport_config().to_dict()  # a plain dict: ConfigDict would refuse wrong types
    cfg[key] = value
    with pytest.raises(ConfigError, match=match):
        validate_transport_config(cfg, "transport")


def test_unknown_key_and_conflicts(tmp_path):
    cfg = transport_config()
    cfg.capacity = 5
    with pytest.raises(ConfigError, match="transport.capacity: unknown key"):
        validate_transport_config(cfg, "transport")
    token = tmp_path / "tok"
    token.write_text("t0k\n")
    cfg = transport_config()
    cfg.auth_token, cfg.auth_token_file = "x", str(token)
    with pytest.raises(ConfigError, match="transport.auth_token: set auth_token or"):
        validate_transport_config(cfg, "transport")
    cfg.auth_token = None
    cfg.host = "0.0.0.0"  # remote binding is fine once a token is configured
    validate_transport_config(cfg, "transport")
    assert client_kwargs(cfg)["token"] == "t0k"


def test_socket_payload_with_tls_names_the_key(tmp_path):
    from transport_testlib import self_signed_pair
    cert, key = self_signed_pair(str(tmp_path))
    cfg = transport_config()
    cfg.tls_cert_file, cfg.tls_key_file, cfg.weight_payload = cert, key, "socket"
    with pytest.raises(ConfigError, match="transport.weight_payload: 'socket' .* TLS"):
        validate_transport_config(cfg, "transport")


@pytest.mark.parametrize("payload", ["grpc", "socket"])
def test_weight_sync_from_config(payload):
    from pipelinerl_jax.transport.transport_section import publisher_kwargs, subscriber_kwargs
    from tests.transport.flat_weights import FlatPublisher as WeightPublisher, FlatSubscriber as WeightSubscriber
    cfg = transport_config()
    cfg.weights_port, cfg.weight_chunk_bytes, cfg.weight_payload = 0, 4096, payload
    validate_transport_config(cfg, "transport")
    got = []
    with WeightPublisher(f"{cfg.host}:{cfg.weights_port}", **publisher_kwargs(cfg)) as pub:
        assert pub.payload == payload
        sub = WeightSubscriber(pub.address, lambda v, p, pv: got.append(v),
                               **subscriber_kwargs(cfg))
        import numpy as np
        pub.publish(0, {"w": np.zeros(5000, np.float32)})
        assert sub.wait_for_version(0, 10)
        sub.close()
    assert got == [0]


def test_server_from_config():
    cfg = transport_config()
    cfg.queue_port, cfg.max_lag, cfg.capacity_rollouts, cfg.max_group_size = 0, 2, 64, 16
    validate_transport_config(cfg, "transport")
    server = RolloutQueueServer.from_config(cfg)
    try:
        assert server.core.max_lag == 2 and server.core.capacity_rollouts == 64
        assert server.address.startswith("127.0.0.1:") and server.port > 0
    finally:
        server.stop(0)


def test_a_fixed_payload_port_is_the_one_the_header_announces_and_a_taken_one_is_named():
    """`transport.weight_payload_port`: where a firewall between hosts must allow the payload
    connection, the listener binds that port (not an ephemeral one); a port already taken
    fails at start naming the address."""
    import socket
    import numpy as np
    from pipelinerl_jax.transport.transport_section import publisher_kwargs, subscriber_kwargs
    from tests.transport.flat_weights import FlatPublisher, FlatSubscriber
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    cfg = transport_config()
    cfg.weights_port, cfg.weight_payload, cfg.weight_payload_port = 0, "socket", port
    validate_transport_config(cfg, "transport")
    got = []
    with FlatPublisher(f"{cfg.host}:0", **publisher_kwargs(cfg)) as pub:
        assert pub.payload_port == port
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            FlatPublisher(f"{cfg.host}:0", **publisher_kwargs(cfg))
        sub = FlatSubscriber(pub.address, lambda v, p, pv: got.append(p["w"].copy()),
                             **subscriber_kwargs(cfg))
        pub.publish(0, {"w": np.arange(5000, dtype=np.float32)})
        assert sub.wait_for_version(0, 10)
        sub.close()
        assert pub.payloads_sent == 1
    np.testing.assert_array_equal(got[0], np.arange(5000, dtype=np.float32))
