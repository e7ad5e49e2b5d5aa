"""`experiments/compile_check.py`'s body: validate, place the roles on their topologies, compile
every program, and summarise (per program, and the estimates a newcomer reads first).

Estimates (compiler-cost rooflines, not measurements):

    decode_tokens_per_s_per_chip   rows / decode step roofline / engine chips, at the largest
                                   attention-length bucket with every slot running; where
                                   the Pallas kernel runs, the step's bytes include the KV
                                   pool reads XLA does not count (`kernel_kv_bytes`,
                                   `programs.pool_bytes_per_token`);
    train_step_s                   the train step's roofline at its largest row bucket (one
                                   micro-batch's, counted once by XLA, times their number);
    sim_costs                      what `sim/` takes (`sim/compiled.py`): one decode step at
                                   two context lengths (with the Pallas kernel, both from one
                                   compile: `decode_cost`), prefill per token, train per token.
"""
from __future__ import annotations

import functools
from typing import Optional

from pipelinerl_jax.aot import chips as chips_lib
from pipelinerl_jax.aot import check, programs
from pipelinerl_jax.config_checks import ConfigError

ROLES = ("learner", "sampler")


def run(cfg, topology: str, sampler_topology: Optional[str] = None, *,
        roles=ROLES, all_buckets: bool = False, dump_dir: Optional[str] = None,
        jobs: int = 1, fast: bool = False,
        log=functools.partial(print, flush=True)) -> dict:
    """The final JSON object of a compile check (module docstring); raises `ConfigError` /
    `TopologyError` before compiling anything. `fast`: the quick check, every program but
    the decode at the compiler's least optimization effort (`check.QUICK_EFFORT`), verdicts
    with `check.QUICK_MARGIN` of the chip kept free; `plan` in the JSON and per program
    says."""
    bad = sorted(set(roles) - set(ROLES))
    if bad or not roles:
        raise chips_lib.TopologyError(f"--roles: {bad or 'none'}; valid: {list(ROLES)}")
    cfg = programs.validate(cfg)
    devices, chip = chips_lib.topology(topology)
    s_devices, s_chip = (chips_lib.topology(sampler_topology) if sampler_topology
                         else (devices, chip))
    learner = programs.learner_devices(cfg, devices)
    worker = programs.worker_devices(cfg, s_devices, shared_with_learner=not sampler_topology)
    if not sampler_topology and not cfg.resources.sampler_devices and worker[0] in learner:
        raise ConfigError("resources.sampler_devices", f"{topology} has no chip left "
                                   "for a sampler after the learner's; give the samplers "
                                   "their own slice (--sampler_topology) or fewer to mesh.shape")
    progs = []
    if "learner" in roles:
        progs += programs.learner_programs(cfg, learner)
    if "sampler" in roles:
        progs += programs.sampler_programs(cfg, worker, all_buckets=all_buckets)
    log(f"{'quick check (least compiler effort but the decode): ' if fast else ''}"
        f"compiling {len(progs)} programs ({jobs} at a time): learner on {len(learner)} x "
        f"{chip.name} ({topology}), each sampler on {len(worker)} x {s_chip.name} "
        f"({sampler_topology or topology})")
    results = check.check_programs(progs, {"learner": chip, "sampler": s_chip}, dump_dir, log,
                                   jobs=jobs, quick=fast)
    failures = check.failures(results)
    for f in failures:
        log(f"FAIL: {f}")
    programs_out = {r.name: r.summary() for r in results}
    return {"topology": topology, "sampler_topology": sampler_topology or topology,
            "chips": {"learner": vars(chip), "sampler": vars(s_chip)},
            "programs": programs_out, "estimates": estimates(programs_out),
            "failures": failures,
            "plan": "quick" if fast else "full"}


def decode_cost(v: dict, length: Optional[int] = None) -> dict:
    """One decode step's cost for the simulator at attention length `length` (default: the
    program's bucket): the compiler's FLOPs and bytes, plus the KV pool reads of the Pallas
    kernel (which XLA counts from the kernel's own, context-free estimate; `kv_bytes_added`:
    rows x length x the pool's bytes a token), and the roofline of the sum on its chip."""
    w = v["work"]
    length = w["cache_len"] if length is None else length
    added = 0
    if v.get("mosaic_calls"):
        per_token = w.get("kv_bytes_per_token")
        if per_token is None:  # a check from before that field: its bucket's reads
            per_token = w.get("kernel_kv_bytes", 0) / (w["rows"] * w["cache_len"])
        added = w["rows"] * length * per_token
    nbytes = v["bytes_accessed"] + added
    chip = chips_lib.CHIPS.get(v["chip"])
    step_s = chip.roofline_s(v["flops"], nbytes) if chip else v["roofline_s"]
    return dict(rows=w["rows"], cache_len=length, step_s=step_s, flops=v["flops"],
                bytes_accessed=nbytes, kv_bytes_added=added)


def estimates(programs: dict) -> dict:
    """The headline numbers from per-program summaries (`Result.summary()`, as in the JSON);
    None where a program is missing. XLA's cost analysis counts a loop's body once: a decode
    chunk's numbers are one step's, a train step's one micro-batch's (plus the update), so
    the step is `chunks` (minibatches x micro-batches) times its roofline."""
    ok = {k: v for k, v in programs.items() if v["compiled"]}
    decode = sorted((v for k, v in ok.items() if k.startswith("engine/decode")),
                    key=lambda v: v["work"]["cache_len"])
    prefill = [v for k, v in ok.items() if k.startswith("engine/prefill")]
    train = ok.get("learner/train_step")
    out = {"decode_tokens_per_s_per_chip": None, "train_step_s": None, "sim_costs": {}}
    costs = out["sim_costs"]
    if decode:
        costs["decode"] = [decode_cost(v) for v in decode]
        # one compile with the Pallas kernel (its costs are length-free): the smallest
        # bucket's point is derived from it
        only = decode[0]
        shortest = only["work"].get("shortest_len")
        if len(decode) == 1 and only.get("mosaic_calls") and shortest and \
                shortest < only["work"]["cache_len"]:
            costs["decode"].insert(0, decode_cost(only, shortest))
        top = costs["decode"][-1]
        out["decode_tokens_per_s_per_chip"] = (top["rows"] / top["step_s"] / decode[-1]["chips"]
                                               if top["step_s"] else None)
        costs["engine_chips"] = decode[-1]["chips"]
    if prefill:
        p = max(prefill, key=lambda v: v["work"]["tokens"])
        costs["prefill_per_token_s"] = p["roofline_s"] / p["work"]["tokens"]
    if train:
        out["train_step_s"] = train["roofline_s"] * train["work"]["chunks"]
        costs["train_per_token_s"] = out["train_step_s"] / train["work"]["tokens"]
        costs["learner_chips"] = train["chips"]
    return out
