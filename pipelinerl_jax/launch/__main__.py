"""`python -m pipelinerl_jax.launch --role=ROLE --workdir=DIR [--index=I]`: one role of a run.

Started by the launcher, a role reads `DIR/config.json` and `DIR/init_checkpoint.txt`.
Started on its own, on any machine (docs/multihost.md), it takes the config like train.py:

    python -m pipelinerl_jax.launch --role=queue|learner|worker|evaluator --workdir=DIR \\
        [--index=I] --config=configs/default.py[:ARG] [--config.KEY=VALUE ...] \\
        [--init_checkpoint=MODEL]

(standalone.py: validated and resolved as the launcher would; fixed ports).
"""
import argparse
import os
import sys

from pipelinerl_jax.launch.roles import ROLES, run_role
from pipelinerl_jax.launch.supervisor import exit_now


def parse_args(argv=None):
    """(role arguments, the `--config...` arguments)."""
    p = argparse.ArgumentParser(prog="python -m pipelinerl_jax.launch",
                                description="Runs one role of a pipelinerl_jax run.")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--index", type=int, default=0, help="worker index")
    p.add_argument("--init_checkpoint", default=None,
                   help="model directory the learner and workers start from (standalone)")
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--config")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, rest


def load_config(config_args):
    """The config of `--config=FILE[:ARG] --config.KEY=VALUE ...` (ml_collections flags),
    parsed without absl's app (its logging setup would hide the roles' logs)."""
    from absl import flags
    from ml_collections import config_flags
    argv = ["pipelinerl_jax.launch"] + list(config_args)
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "Experiment config.",
                                             flag_values=values, lock_config=True,
                                             sys_argv=argv)  # defines the override flags
    values(argv)
    return holder.value


if __name__ == "__main__":
    args, config_args = parse_args()
    workdir = os.path.abspath(args.workdir)
    from pipelinerl_jax.config_checks import ConfigError
    try:
        if config_args:
            from pipelinerl_jax.launch.standalone import prepare
            cfg, init = prepare(load_config(config_args), args.role, workdir, args.index,
                                args.init_checkpoint)
            code = run_role(args.role, workdir, args.index, cfg=cfg, init_checkpoint=init)
        else:
            code = run_role(args.role, workdir, args.index,
                            init_checkpoint=args.init_checkpoint)
    except ConfigError as e:
        sys.exit(f"invalid config: {e}")
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
