"""The security surface: nothing on the wire or in checkpoints is deserialised by a mechanism
that can run code, and the services listen on loopback unless told otherwise.

The source scan walks the syntax tree (not the text), so `model.eval()` or a docstring that
mentions pickle is fine while `eval(...)`, `import pickle`, `yaml.load(...)`,
`np.load(..., allow_pickle=True)` or `torch.load(...)` anywhere in the package, entry points,
scripts or configs fails the test, unless allow-listed below with a reason."""
import ast
import os
import socket

import grpc
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.transport import RolloutQueueServer, transport_config
from pipelinerl_jax.transport.transport_section import validate_transport_config
from tests.transport.flat_weights import FlatPublisher as WeightPublisher
from tests.pipeline_testlib import ROOT

SCANNED = ("pipelinerl_jax", "experiments", "scripts", "configs")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                  "jsonpickle", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec"}
UNSAFE_CALLS = {("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
                ("torch", "load"), ("pd", "read_pickle"), ("pandas", "read_pickle")}
# (path, finding) -> why it is safe. Empty today: keep it that way, or say why here.
ALLOWED: dict = {}


def findings(source: str) -> list:
    """[(line, finding)] of code-executing deserialisation in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names
                    if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] in UNSAFE_MODULES:
            out.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in UNSAFE_BUILTINS:
                out.append((node.lineno, f"{f.id}("))
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                    (f.value.id, f.attr) in UNSAFE_CALLS:
                out.append((node.lineno, f"{f.value.id}.{f.attr}("))
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant)
                                                     and kw.value.value is False):
                    out.append((node.lineno, "allow_pickle="))
    return out


def test_the_scanner_finds_each_pattern():
    snippet = ("import pickle\nfrom dill import loads\nimport numpy as np\neval('1')\n"
               "exec('x=1')\nimport yaml\nyaml.load(s)\nnp.load(f, allow_pickle=True)\n"
               "import torch\ntorch.load(p)\nimport marshal\nmodel.eval()\n"
               "np.load(f, allow_pickle=False)\n'''pickle eval( in a string'''\n")
    got = [f for _, f in findings(snippet)]
    assert got.count("import pickle") == 1 and "from dill import" in got
    assert {"eval(", "exec(", "yaml.load(", "allow_pickle=", "torch.load(",
            "import marshal"} <= set(got)
    assert len(got) == 8  # model.eval(), allow_pickle=False and the string are fine


def test_no_code_executing_deserialisation_in_the_project():
    bad = []
    for top in SCANNED:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), ROOT)
                with open(os.path.join(ROOT, path)) as f:
                    for line, finding in findings(f.read()):
                        if (path, finding) not in ALLOWED:
                            bad.append(f"{path}:{line}: {finding}")
    assert not bad, "code-executing deserialisation (allow-list it with a reason, or " \
                    "remove it):\n" + "\n".join(bad)


def _outbound_ip():
    """This machine's non-loopback address, or None (no route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_services_listen_on_loopback_by_default():
    assert transport_config().host == "127.0.0.1"
    with RolloutQueueServer() as queue, WeightPublisher() as publisher:
        for address in (queue.address, publisher.address):
            host, port = address.rsplit(":", 1)
            assert host == "127.0.0.1"
            ip = _outbound_ip()
            if ip is None:
                continue
            with socket.socket() as s:  # not reachable from the network
                s.settimeout(2)
                assert s.connect_ex((ip, int(port))) != 0, f"{address} reachable on {ip}"
    cfg = transport_config()
    cfg.host = "0.0.0.0"
    with pytest.raises(ConfigError, match="^transport.host: '0.0.0.0' is not a loopback"):
        validate_transport_config(cfg)


def test_the_test_sglang_server_binds_loopback_by_default():
    from pipelinerl_jax.testing.sglang_server import parse_args
    assert parse_args(["--stub"]).host == "127.0.0.1"


def test_grpc_rejects_an_unauthenticated_call_before_the_handler(tmp_path):
    with RolloutQueueServer(token="t0ken") as queue:
        channel = grpc.insecure_channel(queue.address)
        from pipelinerl_jax.transport import rollout_pb2 as pb
        put = channel.unary_unary("/pipelinerl_jax.RolloutQueue/Put",
                                  request_serializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            put(pb.PutRequest().SerializeToString(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert queue.core.stats().put_invalid == 0  # the handler never ran
        channel.close()
