"""BENCHMARKS.md's TPU table from compile checks' JSON files (experiments/compile_check.py
--out=...): per recipe and size, which programs fit (the learner's train step, and the same
with the snapshot a version is published from alive beside it), HBM per chip, and the compiler-cost
estimates (decode tokens/s per chip, train-step time). Estimates, not measurements.

    PYTHONPATH=. python scripts/tpu_table.py results/tpu/*.json
"""
import json
import os
import sys

GIB = 1 << 30


def row(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        s = json.loads(f.read().splitlines()[-1])
    progs = s["programs"]

    def cell(name_prefix):
        ps = [(k, v) for k, v in progs.items() if k.startswith(name_prefix)]
        if not ps:
            return "-"
        k, v = max(ps, key=lambda kv: kv[1]["hbm_bytes_per_chip"])
        mark = "fits" if v["fits"] else ("**no** (compiler: > " if v.get("out_of_memory")
                                          else "**no** (")
        gib = v["hbm_bytes_per_chip"] / GIB
        cap = v["hbm_capacity_bytes"] / GIB
        if v["fits"]:
            return f"{mark} {gib:.1f}/{cap:.1f} GiB"
        return f"{mark}{gib:.1f} of {cap:.1f} GiB)" if v["compiled"] or v.get("out_of_memory") \
            else "**did not compile**"
    est = s["estimates"]
    tps = est.get("decode_tokens_per_s_per_chip")
    train = est.get("train_step_s")
    name = os.path.basename(path)[:-len(".json")]
    slices = s["topology"] if s["sampler_topology"] == s["topology"] else \
        f"{s['topology']} + {s['sampler_topology']}"
    return (f"| {name} | {slices} | {cell('learner/train_step')} | {cell('learner/publish')} | "
            f"{cell('engine/decode')} | "
            f"{cell('engine/prefill')} | {cell('engine/reshard')} | "
            f"{f'{tps:,.0f}' if tps else '-'} | {f'{train:.2f} s' if train else '-'} |")


def main(paths):
    print("| recipe : size | slice(s) | train step | step + published snapshot | decode | "
          "prefill | reshard | decode tok/s/chip (est.) | train step (est.) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        print(row(p))


if __name__ == "__main__":
    main(sys.argv[1:])
