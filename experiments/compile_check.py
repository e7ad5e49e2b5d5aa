"""Will this run fit its TPU slice, and how fast might it go? Answered on a CPU host.

    pip install -e ".[tpu]"          # libtpu: the TPU compiler, no TPU needed
    python experiments/compile_check.py --config=configs/tpu/lora_v5e8.py --topology=v5e:2x4
    python experiments/compile_check.py --config=configs/tpu/full_v5p8_v5e8.py \\
        --topology=v5p:2x2x1 --sampler_topology=v5e:2x4 --dump_hlo=/tmp/hlo
    python experiments/compile_check.py --config=configs/tpu/lora_v5e8.py --fast  # the quick one

Builds the model abstractly (no weights) and AOT-compiles every program the run executes for
its role split (`pipelinerl_jax/aot/programs.py`): the learner's train step, the engine's
prefill and decode buckets, the weight update into the engine's layout. Per program it prints
compiled or the compiler's error, HBM per chip against the chip's capacity, FLOPs and bytes
from the compiler's cost analysis and the roofline time they imply; the last line is one JSON
object. A program that does not compile or fit fails the command, naming the config key.
Roofline times are compiler-cost estimates, not measurements (docs/tpu.md). `--fast` asks the
compiler for its least optimization effort: the same programs in a third of the time, an
HBM plan close to the full one (docs/tpu.md gives the measured gap); the full check stays the
default and is the verdict.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.aot import chips, report  # noqa: E402
from pipelinerl_jax.config_checks import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x4", "The learner's TPU topology "
                                "(and the sampler's unless --sampler_topology): v5e:2x4, "
                                "v5p:2x2x1, v6e:2x4, v4:2x2x1, ...")
_SAMPLER_TOPOLOGY = flags.DEFINE_string("sampler_topology", "", "The samplers' own slice; "
                                        "'' = they share --topology with the learner.")
_ROLES = flags.DEFINE_list("roles", ["learner", "sampler"], "Roles whose programs compile.")
_ALL_BUCKETS = flags.DEFINE_bool("all_buckets", False, "Every prefill and decode bucket, "
                                 "not only the largest (and the smallest decode length).")
_DUMP_HLO = flags.DEFINE_string("dump_hlo", "", "Directory for each program's optimized HLO.")
_OUT = flags.DEFINE_string("out", "", "Also write the final JSON object to this file.")
_JOBS = flags.DEFINE_integer("jobs", 1, "Programs compiled at once (threads; each compile "
                             "holds its own memory: a 7B program peaks at ~5-7 GB).",
                             lower_bound=1)
_FAST = flags.DEFINE_bool("fast", False, "The quick check: the compiler at its lowest "
                          "optimization effort but for the decode (a quarter of the time for "
                          "7B; HBM within 8.4% of the full plan, 10% of the chip kept free; "
                          "FLOPs equal; train-step roofline rough: docs/tpu.md). The full "
                          "check is the verdict.")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    try:
        summary = report.run(_CONFIG.value, _TOPOLOGY.value,
                             _SAMPLER_TOPOLOGY.value or None, roles=tuple(_ROLES.value),
                             all_buckets=_ALL_BUCKETS.value, dump_dir=_DUMP_HLO.value or None,
                             jobs=_JOBS.value, fast=_FAST.value)
    except (ConfigError, chips.TopologyError) as e:  # before anything compiled: name the key
        sys.exit(f"config error: {e}")
    line = json.dumps(summary, sort_keys=True)
    if _OUT.value:
        with open(_OUT.value, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line)
    if summary["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
