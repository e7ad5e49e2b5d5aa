"""The checked-in generated modules match rollout.proto, and the server serves exactly the
methods the proto declares."""
import ast
import re


from pipelinerl_jax.transport import gen_proto, rollout_pb2
from pipelinerl_jax.transport.queue_server import RolloutQueueServer
from tests.optional_deps import optional


def _descriptor_bytes(path: str) -> bytes:
    """The serialized FileDescriptorProto embedded in a generated *_pb2.py."""
    text = open(path).read()
    m = re.search(r"AddSerializedFile\((b'.*?')\)\n", text, re.S)
    assert m, f"no serialized descriptor in {path}"
    return ast.literal_eval(m.group(1))


def _method_paths(path: str) -> set:
    return set(re.findall(r"'(/pipelinerl_jax\.\w+/\w+)'", open(path).read()))


def test_generated_modules_are_current(tmp_path):
    optional("grpc_tools")  # grpcio-tools regenerates the modules
    fresh_pb2, fresh_grpc = gen_proto.generate(str(tmp_path))
    base = f"{gen_proto.REPO_ROOT}/pipelinerl_jax/transport"
    # The descriptor captures every message, field and service of the .proto; comparing it
    # (not the text) keeps the check stable across protoc releases that only restyle code.
    assert _descriptor_bytes(fresh_pb2) == _descriptor_bytes(f"{base}/rollout_pb2.py"), (
        "rollout_pb2.py is stale: run `python -m pipelinerl_jax.transport.gen_proto`")
    assert _method_paths(fresh_grpc) == _method_paths(f"{base}/rollout_pb2_grpc.py"), (
        "rollout_pb2_grpc.py is stale: run `python -m pipelinerl_jax.transport.gen_proto`")


def test_server_implements_every_declared_method():
    service = rollout_pb2.DESCRIPTOR.services_by_name["RolloutQueue"]
    declared = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    server = RolloutQueueServer()
    try:
        assert server.method_kinds == declared
    finally:
        server.stop(0)
