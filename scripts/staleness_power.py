"""The staleness protocol's seed count: seeds for a 5-point effect at 80% power on the primary
endpoint (final held-out accuracy), from the committed runs' paired SDs.

  PYTHONPATH=. python scripts/staleness_power.py --results=results/staleness_study/main

For the protocol's confirmatory families at the committed learning rate (family 1: each key
arm at each confirmatory lag vs its lag 0; family 2: each key arm vs PPO-clip at the same lag;
pipelinerl_jax/ablation/protocol.py) it prints the paired SD of every comparison present in
the committed runs, the planning SD (their root mean square over both families), and the
fewest seed pairs whose two-sided paired t-test detects `--effect` with 80% power at level
alpha / m (Bonferroni over the larger family, m comparisons: the first step of Holm, so the
count holds for every comparison of the family, not only the most significant) and, for
reference, at alpha. Prints the table and one JSON line.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from pipelinerl_jax.ablation import protocol, results, staleness  # noqa: E402

_RESULTS = flags.DEFINE_list("results", ["results/staleness_study/main"],
                             "Committed-table folders or grid directories.")
_EFFECT = flags.DEFINE_float("effect", 0.05, "The effect to detect (accuracy, 0.05 = 5 pts).")
_LR = flags.DEFINE_float("lr", 2e-4, "The learning rate whose runs plan the grid.")
# The committed runs predate the authors' m2po arm: the SDs come from the key arms present.
_ARMS = flags.DEFINE_list("arms", list(protocol.KEY_ARMS), "Key arms.")
_LAGS = flags.DEFINE_list("lags", [str(k) for k in protocol.CONFIRM_LAGS], "Confirmatory lags.")
_ALPHA = flags.DEFINE_float("alpha", protocol.ALPHA, "Family-wise level.")


def main(argv):
    del argv
    runs, _ = results.load_runs(_RESULTS.value)
    grids = staleness.by_learning_rate(runs)
    lr = min(grids, key=lambda x: abs(x - _LR.value))
    grid = staleness.main_arms(grids[lr])
    lags = [int(k) for k in _LAGS.value]
    fn = staleness.final_accuracy
    f1 = protocol.staleness_cost(grid, fn, _ARMS.value, lags)
    f2 = protocol.versus_reference(grid, fn, _ARMS.value, lags)
    # the families of the new grid, where every key arm is present (m2po_authors included)
    m = max(len(_ARMS.value) * len(lags), (len(_ARMS.value) - 1) * len(lags))
    sd = protocol.planning_sd(f1 + f2)
    need = protocol.seeds_for_power(_EFFECT.value, sd, _ALPHA.value / m)
    need_alpha = protocol.seeds_for_power(_EFFECT.value, sd, _ALPHA.value)
    print(f"learning rate {lr:g}; committed comparisons on final held-out accuracy:")
    print("| family | a | b | seeds | paired SD (pts) |\n|---|---|---|---|---|")
    for r in f1 + f2:
        print(f"| {r['family']} | {r['a']} @ {r['lag_a']} | {r['b']} @ {r['lag_b']} | {r['n']} | "
              f"{100 * r['sd']:.1f} |")
    print(f"\nplanning SD (RMS over {len(f1 + f2)} comparisons): {100 * sd:.2f} pts; family size "
          f"m = {m}; seeds for {100 * _EFFECT.value:g} pts at 80% power: {need} at alpha/m = "
          f"{_ALPHA.value / m:.4f} ({need_alpha} at alpha = {_ALPHA.value:g}); power at that "
          f"count {protocol.power(_EFFECT.value, sd, need, _ALPHA.value / m):.3f}")
    print(json.dumps({"lr": lr, "comparisons": len(f1 + f2), "planning_sd": sd, "family_size": m,
                      "effect": _EFFECT.value, "seeds": need, "seeds_at_alpha": need_alpha}))


if __name__ == "__main__":
    app.run(main)
