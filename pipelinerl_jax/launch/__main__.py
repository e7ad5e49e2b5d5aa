"""`python -m pipelinerl_jax.launch --role=ROLE --workdir=DIR [--index=I]`: one child role."""
import argparse
import os
import sys

from pipelinerl_jax.launch.roles import ROLES, run_role
from pipelinerl_jax.launch.supervisor import exit_now


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipelinerl_jax.launch",
                                description="Runs one role of a pipelinerl_jax run.")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--index", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    try:
        code = run_role(args.role, os.path.abspath(args.workdir), args.index)
    except BaseException:  # noqa: BLE001
        # A child that fails must exit, so the launcher sees it: an exception that skipped
        # the child's cleanup leaves non-daemon threads (gRPC servers, checkpoint and
        # TensorBoard writers) that would keep the interpreter alive forever.
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    exit_now(code)
