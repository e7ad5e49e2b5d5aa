"""How far the quick compile check (`--fast`) is from the full one, program by program.

    PYTHONPATH=. python scripts/tpu_quick_vs_full.py QUICK.json FULL.json [QUICK2 FULL2 ...]

Each pair is the final JSON of `experiments/compile_check.py --fast` and of the same command
without it. Prints, per program, HBM per chip (quick / full, relative gap), whether the
verdicts agree, FLOPs and bytes accessed gaps, then the estimates' gaps; the last line is one
JSON object with the largest gaps over every pair (`max_hbm_gap`, `max_flops_gap`,
`max_bytes_gap`, `verdicts_agree`; FLOPs of programs with over a GFLOP). A gap is
(quick - full) / full. A verdict of the quick check inside its margin is not a disagreement
when it sends the user to the full check (`too close`).
"""
import json
import sys


def gap(q, f):
    return (q - f) / f if f else (0.0 if q == f else float("inf"))


def compare(quick: dict, full: dict) -> dict:
    rows = []
    for name, f in sorted(full["programs"].items()):
        q = quick["programs"].get(name)
        if q is None:
            rows.append(dict(program=name, missing=True))
            continue
        rows.append(dict(program=name, hbm_quick=q["hbm_bytes_per_chip"],
                         hbm_full=f["hbm_bytes_per_chip"],
                         hbm_gap=gap(q["hbm_bytes_per_chip"], f["hbm_bytes_per_chip"]),
                         same_verdict=q["fits"] == f["fits"] or (
                             not q["fits"] and q["hbm_bytes_per_chip"] <= q["hbm_capacity_bytes"]),
                         flops_gap=gap(q["flops"], f["flops"]), flops_full=f["flops"],
                         bytes_gap=gap(q["bytes_accessed"], f["bytes_accessed"]),
                         compile_s=(q["compile_s"], f["compile_s"])))
    est = {}
    for key in ("decode_tokens_per_s_per_chip", "train_step_s"):
        a, b = quick["estimates"].get(key), full["estimates"].get(key)
        if a is not None and b is not None:
            est[key] = gap(a, b)
    return dict(rows=rows, estimates=est)


def main(paths):
    if not paths or len(paths) % 2:
        sys.exit(__doc__)
    out = dict(max_hbm_gap=0.0, max_flops_gap=0.0, max_bytes_gap=0.0, verdicts_agree=True,
               missing=[])
    for qp, fp in zip(paths[::2], paths[1::2]):
        with open(qp, encoding="utf-8") as f:
            quick = json.load(f)
        with open(fp, encoding="utf-8") as f:
            full = json.load(f)
        if not str(quick.get("plan", "")).startswith("quick"):
            sys.exit(f"{qp} is not a quick check (plan {quick.get('plan')!r})")
        c = compare(quick, full)
        print(f"\n{qp} vs {fp}\n| program | HBM/chip quick / full GiB | gap | same verdict | "
              f"FLOPs gap | bytes gap | compile s quick / full |\n|---|---|---|---|---|---|---|")
        for r in c["rows"]:
            if r.get("missing"):
                print(f"| {r['program']} | missing from the quick check | | | | | |")
                out["missing"].append(r["program"])
                continue
            print(f"| {r['program']} | {r['hbm_quick'] / 2**30:.2f} / {r['hbm_full'] / 2**30:.2f}"
                  f" | {100 * r['hbm_gap']:+.1f}% | {r['same_verdict']} | "
                  f"{100 * r['flops_gap']:+.2f}% | {100 * r['bytes_gap']:+.0f}% | "
                  f"{r['compile_s'][0]:.0f} / {r['compile_s'][1]:.0f} |")
            out["max_hbm_gap"] = max(out["max_hbm_gap"], abs(r["hbm_gap"]))
            if r["flops_full"] >= 1e9:  # a weight copy's few casts: no FLOPs to compare
                out["max_flops_gap"] = max(out["max_flops_gap"], abs(r["flops_gap"]))
            out["max_bytes_gap"] = max(out["max_bytes_gap"], abs(r["bytes_gap"]))
            out["verdicts_agree"] &= r["same_verdict"]
        print("estimates, quick vs full: " + ", ".join(
            f"{k} {100 * v:+.0f}%" for k, v in c["estimates"].items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
