"""Regenerates `rollout_pb2.py` / `rollout_pb2_grpc.py` from `rollout.proto`.

    python -m pipelinerl_jax.transport.gen_proto            # rewrite the checked-in modules
    python -m pipelinerl_jax.transport.gen_proto --out DIR  # write DIR/pipelinerl_jax/transport/

protoc runs with the repository root as include path, so the generated gRPC module imports
`pipelinerl_jax.transport.rollout_pb2` by its package path. The gencode records the protobuf
version it needs (`_runtime_version` check); setup.py's `protobuf` lower bound matches it.
"""
from __future__ import annotations

import argparse
import os
import sys

PROTO_REL = os.path.join("pipelinerl_jax", "transport", "rollout.proto")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(out_root: str = REPO_ROOT) -> list[str]:
    """Runs protoc; returns the paths of the two generated modules."""
    from grpc_tools import protoc  # dev dependency (grpcio-tools); not needed at run time
    import importlib.resources  # build tool only

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    os.makedirs(out_root, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{well_known}",
                      f"--python_out={out_root}", f"--grpc_python_out={out_root}",
                      os.path.join(REPO_ROOT, PROTO_REL)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    base = os.path.join(out_root, "pipelinerl_jax", "transport")
    return [os.path.join(base, "rollout_pb2.py"), os.path.join(base, "rollout_pb2_grpc.py")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=REPO_ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
