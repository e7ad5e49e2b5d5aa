"""Which conclusions of one staleness grid hold in another setting (the protocol's external
validity: docs/staleness_study.md; the rule in pipelinerl_jax/ablation/validity.py).

  PYTHONPATH=. python scripts/staleness_validity.py --base=results/staleness_protocol/main \\
      --other=results/staleness_protocol/large --out=results/staleness_protocol/large/validity.md

Both are lag-injected grids (committed tables or run directories). Each one's protocol
families 1 and 2 are computed on the primary endpoint (final held-out accuracy) with its own
Holm correction, at the learning rate both hold (--lr to choose among several), and every
comparison of the first gets a verdict in the second, the unfavourable first: reverses, not
seen, unresolved, appears, holds, null in both, not run. Each grid's null control (family 0)
is printed above the table; if either fails, every verdict is void (the protocol makes no
claim of that grid). `--json` also prints the rows as one JSON line.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import protocol, results, staleness, validity  # noqa: E402

_BASE = flags.DEFINE_list("base", [], "The grid whose conclusions are carried (tables or runs).")
_OTHER = flags.DEFINE_list("other", [], "The grid of the other setting (tables or runs).")
_NAMES = flags.DEFINE_list("names", [], "Two names for the table (default: folder names).")
_LR = flags.DEFINE_float("lr", None, "The learning rate to compare at (default: the one both "
                         "grids hold).")
_ARMS = flags.DEFINE_list("confirm_arms", list(protocol.KEY_ARMS), "The key arms.")
_LAGS = flags.DEFINE_list("confirm_lags", [str(k) for k in protocol.CONFIRM_LAGS],
                          "The confirmatory lags.")
_OUT = flags.DEFINE_string("out", "", "Markdown file to write (default: print only).")
_JSON = flags.DEFINE_bool("json", False, "Also print the rows as one JSON line.")


def _grid(paths, what):
    runs, problems = results.load_runs(paths)
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    groups = staleness.by_learning_rate(runs)
    if not groups:
        raise app.UsageError(f"--{what}: no lag-injected runs with evaluations under "
                             + ",".join(paths))
    return groups


def main(argv):
    del argv
    if not _BASE.value or not _OTHER.value:
        raise app.UsageError("give --base=DIR and --other=DIR")
    base, other = _grid(_BASE.value, "base"), _grid(_OTHER.value, "other")
    shared = sorted(set(base) & set(other))
    if _LR.value is not None:
        if _LR.value not in shared:
            raise app.UsageError(f"--lr={_LR.value:g}: the grids hold {sorted(base)} and "
                                 f"{sorted(other)}")
        lr = _LR.value
    elif len(shared) == 1:
        lr = shared[0]
    else:
        raise app.UsageError(f"the grids share learning rates {shared} (need exactly one, or "
                             "--lr)")
    lags = [int(k) for k in _LAGS.value]
    fn = staleness.final_accuracy
    names = _NAMES.value or [os.path.basename(os.path.normpath(p[0]))
                             for p in (_BASE.value, _OTHER.value)]
    if len(names) != 2:
        raise app.UsageError("--names takes two names")
    fams = [protocol.families(staleness.main_arms(g[lr]), fn, _ARMS.value, lags)[1]
            for g in (base, other)]
    rows = validity.across(*fams)
    nulls = {n: validity.null_control(f) for n, f in zip(names, fams)}
    for r in rows:  # a failed null control voids every verdict (no claim of that grid)
        r["void"] = not all(ok for ok, _, _ in nulls.values())
    text = "\n".join([f"## Which conclusions of `{names[0]}` hold in `{names[1]}` (learning "
                      f"rate {lr:g}, primary endpoint)", "",
                      validity.markdown(rows, names[0], names[1], nulls=nulls), ""])
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(text)
    print(text)
    if _JSON.value:
        print(json.dumps(rows, default=str))


if __name__ == "__main__":
    app.run(main)
