"""Re-derives a compile check's estimates without compiling again: each decode program's
`work.kernel_kv_bytes` (the Pallas kernel's KV pool reads, which XLA does not count; added to
the check on 2026-12-04) is rebuilt from the run's config, abstractly, and `estimates` is
recomputed by `report.estimates`. For the JSON files of checks made before that field existed.

    PYTHONPATH=. python scripts/tpu_reestimate.py --config=configs/tpu/lora_v5e8.py \\
        --topology=v5e:2x4 --json=results/tpu/lora_v5e8_qwen2.5-7b.json

The compiled figures (HBM, FLOPs, bytes) are the file's own; only the estimates change.
"""
import json

from absl import app, flags
from ml_collections import config_flags

from pipelinerl_jax.aot import chips, programs, report

_CONFIG = config_flags.DEFINE_config_file("config", None, "The run's config file.",
                                          lock_config=False)
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x4", "The learner's topology, as checked.")
_SAMPLER_TOPOLOGY = flags.DEFINE_string("sampler_topology", "", "The samplers' slice, as "
                                        "checked.")
_JSON = flags.DEFINE_string("json", None, "The check's JSON file, rewritten in place.")
flags.mark_flags_as_required(["config", "json"])


def main(argv):
    del argv
    cfg = programs.validate(_CONFIG.value)
    shared = not _SAMPLER_TOPOLOGY.value
    devices, _ = chips.topology(_SAMPLER_TOPOLOGY.value or _TOPOLOGY.value)
    worker = programs.worker_devices(cfg, devices, shared_with_learner=shared)
    work = {p.name: p.work for p in programs.sampler_programs(cfg, worker)}
    with open(_JSON.value, encoding="utf-8") as f:
        summary = json.loads(f.read().splitlines()[-1])
    for name, prog in summary["programs"].items():
        if name.startswith("engine/decode"):
            prog["work"]["kernel_kv_bytes"] = work[name]["kernel_kv_bytes"]
    summary["estimates"] = report.estimates(summary["programs"])
    with open(_JSON.value, "w", encoding="utf-8") as f:
        f.write(json.dumps(summary, sort_keys=True) + "\n")
    print(json.dumps(summary["estimates"]))


if __name__ == "__main__":
    app.run(main)
