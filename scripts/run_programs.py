"""Run the programs `experiments/compile_check.py` compiles, for real, on this host's accelerators.

    python scripts/run_programs.py --config=configs/tpu/lora_v5e8.py [--repeats=5]

The same `pipelinerl_jax/aot/programs.py` builders place the run's roles on `jax.devices()`
(as the check places them on a topology), compile each program for the real devices, fill
its inputs with zeros in their shardings (a decode's slots made active, so its loop runs all
`engine.steps_per_sync` steps), run it `--repeats` times and report, per program, the
median wall time beside the compiler's roofline (on a TPU of the chip table) and the peak
device memory in use beside the compiler's plan. Prints one JSON object last
(scripts/device_check.sh's `programs` part runs it).
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from pipelinerl_jax.aot import chips, check, programs  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "The run's config.",
                                          lock_config=True)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per program (after one warm call).")


def zeros_like(args, shardings):
    """Zero arrays of the lowered program's argument shapes, in its input shardings."""
    def one(aval, sharding):
        return jax.jit(lambda: jnp.zeros(aval.shape, aval.dtype), out_shardings=sharding)()
    return jax.tree.map(one, args, shardings)


def peak_bytes(devices) -> int:
    stats = [d.memory_stats() or {} for d in devices]
    return max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)


def run_one(prog, chip, repeats: int) -> dict:
    compiled = prog.lower().compile()
    planned = check.hbm_total(check.memory_of(compiled))
    flops, nbytes = check.cost_of(compiled)

    def fresh():  # donated inputs are consumed: every call gets its own
        args = zeros_like(compiled.in_avals[0], compiled.input_shardings[0])
        args = prog.busy(args) if prog.busy is not None else args
        return jax.block_until_ready(args)
    times = []
    for i in range(repeats + 1):  # the first call is a warm-up
        args = fresh()
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        if i:
            times.append(time.perf_counter() - t0)
        del args
    out = {"wall_s": statistics.median(times), "planned_hbm_bytes_per_chip": planned,
           "peak_bytes_in_use": peak_bytes(prog.devices), "flops": flops,
           "bytes_accessed": nbytes, "work": prog.work}
    if chip is not None:
        roof = chip.roofline_s(flops, nbytes) * prog.work.get("steps", 1)
        out.update(roofline_s=roof, of_roofline=roof / out["wall_s"])
    return out


def main(argv):
    del argv
    cfg = programs.validate(_CONFIG.value)
    devices = jax.devices()
    try:
        chip = chips.chip_of_device_kind(devices[0].device_kind)
    except chips.TopologyError:
        chip = None  # not a TPU of the table: times only
    learner = programs.learner_devices(cfg, devices)
    worker = programs.worker_devices(cfg, devices, shared_with_learner=True)
    progs = programs.learner_programs(cfg, learner) + programs.sampler_programs(cfg, worker)
    result = {"device_kind": devices[0].device_kind, "devices": len(devices), "programs": {}}
    for prog in progs:
        try:
            result["programs"][prog.name] = run_one(prog, chip, _REPEATS.value)
        except Exception as e:  # noqa: BLE001 - report and go on to the next program
            result["programs"][prog.name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(prog.name, json.dumps(result["programs"][prog.name]), flush=True)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
