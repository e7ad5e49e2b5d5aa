"""Compile a run's programs for TPU topologies on a CPU host and judge them against the chip.

For each `programs.Program`: lower and compile it for the topology (libtpu's compiler), then
read what the compiler reports for one chip of the SPMD program:

    hbm_bytes_per_chip = arguments + outputs - aliased (donated) + temporaries + code
                         (+ the arguments of `resident_from`, held while it runs; or, with
                         `alongside`, that program's whole footprint + this one's outputs,
                         the two live together); XLA:TPU
                         refuses to compile a program whose buffers exceed the chip, and
                         its message (temporaries needed, HBM available) is the verdict
    flops, bytes_accessed   from `cost_analysis()` (XLA's HLO cost model; a Mosaic kernel
                         counts what its `pl.CostEstimate` declares)
    roofline_s         max(flops / peak bf16 FLOP/s, bytes_accessed / HBM bandwidth)

A decode chunk is a `while_loop`: XLA's cost analysis counts its body once, so its FLOPs and
bytes are one decode step's and `roofline_s` is per step (`per_call_s` = steps x that); the
same for the train step's scan over micro-batches (`per_call_s` = chunks x that). The
roofline is a lower bound from the compiler's cost model, not a measurement: it ignores
collectives' latency, kernel efficiency and the host.
"""
from __future__ import annotations

import dataclasses
import os
from concurrent import futures
import re
import time
from typing import Dict, List, Optional

from pipelinerl_jax.aot.chips import Chip
from pipelinerl_jax.aot.programs import Program, default_device


@dataclasses.dataclass
class Result:
    name: str
    role: str
    compiled: bool
    chip: str
    chips: int
    config_key: str
    work: dict
    error: str = ""
    compile_s: float = 0.0
    memory: Dict[str, int] = dataclasses.field(default_factory=dict)
    hbm_bytes_per_chip: int = 0
    hbm_capacity_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    roofline_s: float = 0.0
    mosaic_calls: int = 0
    out_of_memory: bool = False  # the compiler refused: more HBM than the chip has
    effort: Optional[float] = None  # `exec_time_optimization_effort`; None: the full plan
    margin: float = 0.0  # the share of the chip a verdict keeps free (the quick plan's error)

    @property
    def fits(self) -> bool:
        return self.compiled and \
            self.hbm_bytes_per_chip <= self.hbm_capacity_bytes * (1 - self.margin)

    @property
    def too_close(self) -> bool:
        """Fits the chip but not inside the quick plan's margin: only the full plan can say."""
        return (self.compiled and not self.fits and
                self.hbm_bytes_per_chip <= self.hbm_capacity_bytes)

    def summary(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "compiled", "hbm_bytes_per_chip", "hbm_capacity_bytes", "flops", "bytes_accessed",
            "roofline_s")}
        out.update(fits=self.fits, out_of_memory=self.out_of_memory, role=self.role,
                   plan="full" if self.effort is None else "quick", margin=self.margin,
                   chip=self.chip, chips=self.chips,
                   memory=self.memory, work=self.work, mosaic_calls=self.mosaic_calls,
                   compile_s=round(self.compile_s, 1))
        loops = self.work.get("steps") or self.work.get("chunks")
        if loops:  # a loop's body is counted once (module docstring)
            out["per_call_s"] = self.roofline_s * loops
        if self.error:
            out["error"] = self.error
        return out


def memory_of(compiled) -> Dict[str, int]:
    m = compiled.memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
            "aliased": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
            "code": int(m.generated_code_size_in_bytes)}


def hbm_total(mem: Dict[str, int]) -> int:
    return (mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temporaries"]
            + mem["code"])


def cost_of(compiled) -> tuple:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per module
        cost = cost[0] if cost else {}
    cost = cost or {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_OOM = re.compile(r"memory required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds "
                  r"available HBM \(([\d.]+)([KMGT])\)")


def out_of_memory(message: str):
    """(bytes the program's temporaries need, bytes the compiler says a chip has) from
    XLA:TPU's out-of-memory compile error; None for any other error. The need is a lower
    bound (arguments and outputs come on top)."""
    m = _OOM.search(message)
    if not m:
        return None
    return (int(float(m.group(1)) * _UNITS[m.group(2)]),
            int(float(m.group(3)) * _UNITS[m.group(4)]))


def mosaic_calls(hlo_text: str) -> int:
    """Mosaic (Pallas TPU) kernel calls in optimized HLO text."""
    return len(re.findall(r'custom_call_target="tpu_custom_call"', hlo_text))


# The quick check (`--fast`): every program but those in QUICK_FULL_PLAN compiles with XLA's
# executable build option `exec_time_optimization_effort` at its floor. Measured on the
# 7B/8B recipes (docs/tpu.md, "The quick check"): a quarter to a third of the compile time;
# HBM per chip within 8.4% of the full plan (lower where it differed), so a quick verdict
# keeps QUICK_MARGIN of the chip free; FLOPs equal; the cost analysis's bytes 7-67% lower
# (another fusion plan), so the decode, whose speed estimate is bytes-bound, keeps the full
# plan, and the train step's estimate is rough (-11% to -48%).
QUICK_EFFORT = -1.0
QUICK_FULL_PLAN = ("engine/decode",)
QUICK_MARGIN = 0.10


def quick_plan(name: str) -> bool:
    """Whether the quick check compiles program `name` at the least effort."""
    return not name.startswith(QUICK_FULL_PLAN)


def compile_program(prog: Program, chip: Chip, dump_dir: Optional[str] = None,
                    effort: Optional[float] = None) -> tuple:
    """(Result, the argument bytes per chip) of one program; a compiler error is a result.
    `effort`: XLA's `exec_time_optimization_effort` (None: the default a run compiles with)."""
    res = Result(prog.name, prog.role, False, chip.name, len(prog.devices), prog.config_key,
                 prog.work, hbm_capacity_bytes=int(chip.hbm_bytes), effort=effort,
                 margin=QUICK_MARGIN if effort is not None else 0.0)
    t0 = time.perf_counter()
    try:
        with default_device(prog.devices):
            options = None if effort is None else {"exec_time_optimization_effort": effort}
            compiled = prog.lower().compile(compiler_options=options)
    except Exception as e:  # the compiler's own message is the result
        res.error = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        res.compile_s = time.perf_counter() - t0
        need = out_of_memory(res.error)
        if need:  # XLA:TPU refuses to compile what cannot fit: a verdict, not a crash
            res.out_of_memory = True
            res.memory = {"temporaries": need[0]}
            res.hbm_bytes_per_chip = need[0]
            res.hbm_capacity_bytes = need[1]  # what the compiler says a chip has
        return res, 0
    res.compile_s = time.perf_counter() - t0
    res.compiled = True
    res.memory = memory_of(compiled)
    res.hbm_bytes_per_chip = hbm_total(res.memory)
    res.flops, res.bytes_accessed = cost_of(compiled)
    res.roofline_s = chip.roofline_s(res.flops, res.bytes_accessed)
    text = compiled.as_text() or ""
    res.mosaic_calls = mosaic_calls(text)
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        fname = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", prog.name) + ".hlo.txt"
        with open(os.path.join(dump_dir, fname), "w", encoding="utf-8") as f:
            f.write(text)
    return res, res.memory["arguments"]


def check_programs(progs: List[Program], chips: Dict[str, Chip],
                   dump_dir: Optional[str] = None, log=print, jobs: int = 1,
                   quick: bool = False) -> List[Result]:
    """Compiles `progs` (role -> its chip in `chips`), adds resident bytes, logs each (in
    program order). `jobs` > 1 compiles that many at once on threads: XLA compiles with
    Python's lock released, and JAX's config contexts (the default device) are per thread;
    each compile holds its own memory, so peak memory grows with `jobs`. `quick`: the quick
    check's plan (`QUICK_EFFORT` where `quick_plan`)."""
    def one(prog):
        effort = QUICK_EFFORT if quick and quick_plan(prog.name) else None
        return compile_program(prog, chips[prog.role], dump_dir, effort)
    if jobs > 1:
        pool = futures.ThreadPoolExecutor(jobs, "compile")
        pending = [pool.submit(one, p) for p in progs]
        compiled = (f.result() for f in pending)  # in program order, as each is done
    else:
        pool, compiled = None, (one(p) for p in progs)
    results, args, totals = [], {}, {}
    try:
        for prog, (res, arg_bytes) in zip(progs, compiled):
            args[prog.name] = arg_bytes
            if res.compiled and prog.resident_from:
                res.memory["resident"] = args.get(prog.resident_from, 0)
                res.hbm_bytes_per_chip += res.memory["resident"]
            if res.compiled and prog.alongside:
                res.memory["alongside"] = totals.get(prog.alongside, 0)
                res.hbm_bytes_per_chip = res.memory["outputs"] + res.memory["alongside"]
            totals[prog.name] = res.hbm_bytes_per_chip
            results.append(res)
            log(describe(res))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def describe(r: Result) -> str:
    gib = 1 << 30
    head = f"{r.name} on {r.chips} x {r.chip}"
    if r.out_of_memory:
        return (f"{head}: DOES NOT FIT (the compiler, {r.compile_s:.0f} s): temporaries alone "
                f"need {r.hbm_bytes_per_chip / gib:.2f} of {r.hbm_capacity_bytes / gib:.2f} GiB"
                f"\n    {r.error}")
    if not r.compiled:
        return f"{head}: DID NOT COMPILE ({r.compile_s:.0f} s)\n    {r.error}"
    m = r.memory
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in m.items() if v)
    verdict = ("fits" if r.fits else "TOO CLOSE FOR THE QUICK CHECK" if r.too_close
               else "DOES NOT FIT")
    if r.effort is not None:
        verdict += f" (quick plan: {r.margin:.0%} of the chip kept free)"
    steps, chunks = r.work.get("steps"), r.work.get("chunks")
    per = (f" per step ({steps} steps a call)" if steps else
           f" per micro-batch ({chunks} a step)" if chunks and chunks > 1 else "")
    return (f"{head}: compiled in {r.compile_s:.0f} s; HBM/chip {r.hbm_bytes_per_chip / gib:.2f}"
            f" of {r.hbm_capacity_bytes / gib:.2f} GiB ({parts}) -> {verdict}\n"
            f"    {r.flops / 1e12:.3f} TFLOP, {r.bytes_accessed / 1e9:.3f} GB accessed{per}; "
            f"roofline {r.roofline_s * 1e3:.3f} ms" +
            (f"; {r.mosaic_calls} Mosaic kernel calls" if r.mosaic_calls else ""))


def failures(results: List[Result]) -> List[str]:
    """One message per program that did not compile or does not fit, naming the key."""
    out = []
    for r in results:
        if r.out_of_memory:
            out.append(f"{r.name} needs more than {r.hbm_bytes_per_chip / (1 << 30):.2f} GiB "
                       f"per chip, a {r.chip} has {r.hbm_capacity_bytes / (1 << 30):.2f} GiB; "
                       f"change {r.config_key}")
        elif not r.compiled:
            out.append(f"{r.name} did not compile for {r.chip}; change {r.config_key}")
        elif r.too_close:
            out.append(f"{r.name} needs {r.hbm_bytes_per_chip / (1 << 30):.2f} GiB per chip of "
                       f"a {r.chip}'s {r.hbm_capacity_bytes / (1 << 30):.2f}: inside the quick "
                       f"check's {r.margin:.0%} margin; run the full check (without --fast) "
                       f"or change {r.config_key}")
        elif not r.fits:
            out.append(f"{r.name} needs {r.hbm_bytes_per_chip / (1 << 30):.2f} GiB per chip, a "
                       f"{r.chip} has {r.hbm_capacity_bytes / (1 << 30):.2f} GiB; change "
                       f"{r.config_key}")
    return out
