"""The protocol's statistics against hand-computed and published values, and its families on
a synthetic grid (pipelinerl_jax/ablation/protocol.py)."""
import math

import numpy as np
import pytest
from scipy import stats as sps

from pipelinerl_jax.ablation import protocol


def test_holm_matches_a_hand_computed_example():
    # sorted: 0.005 x4 = 0.02; 0.01 x3 = 0.03; 0.03 x2 = 0.06; 0.04 x1 = 0.04 -> max so far 0.06
    got = protocol.holm([0.01, 0.04, 0.03, 0.005])
    assert got == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1, monotone in the sorted order, nan neither counted nor adjusted
    got = protocol.holm([0.5, float("nan"), 0.2])
    assert got[0] == pytest.approx(0.5) and got[2] == pytest.approx(0.4)
    assert math.isnan(got[1])
    assert protocol.holm([0.9, 0.8]) == [1.0, 1.0]  # 2 x 0.8 capped; then max(1, 0.9)
    assert protocol.holm([0.04, 0.3]) == pytest.approx([0.08, 0.3])


def test_paired_p_is_scipys_paired_t_test():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.5, 0.1, 12), rng.normal(0.45, 0.1, 12)
    assert protocol.paired_p(a - b) == pytest.approx(sps.ttest_rel(a, b).pvalue, rel=1e-12)
    assert math.isnan(protocol.paired_p([0.1]))


def test_power_matches_the_published_value():
    # Paired t-test, effect size dz = 0.5, two-sided alpha 0.05: 34 pairs give power 0.8078
    # (G*Power 3.1; Cohen 1988's tables give n = 34 for 80%).
    assert protocol.power(0.5, 1.0, 34) == pytest.approx(0.8078, abs=5e-4)
    assert protocol.seeds_for_power(0.5, 1.0) == 34
    # the MDE is the effect whose power is 80%, and scales with the SD
    d = protocol.mde(0.07, 30)
    assert protocol.power(d, 0.07, 30) == pytest.approx(0.8, abs=1e-6)
    assert protocol.mde(0.14, 30) == pytest.approx(2 * d, rel=1e-6)
    # far tails: scipy's nct.cdf is NaN at nc ~20 with 11 df; power and the MDE stay finite
    assert protocol.power(20.0, 6.83, 12) == pytest.approx(1.0)
    d12 = protocol.mde(6.83, 12)
    assert protocol.power(d12, 6.83, 12) == pytest.approx(0.8, abs=1e-6)
    # a stricter level needs more seeds
    assert protocol.seeds_for_power(0.05, 0.07, alpha=0.05 / 12) > \
        protocol.seeds_for_power(0.05, 0.07)


class _Run:
    def __init__(self, acc, mb=1):
        self.acc, self.mb = acc, mb

    def get(self, key, default=None):
        return self.mb if key == "learner.minibatches" else default


def _grid(seeds=8):
    rng = np.random.default_rng(0)
    base = rng.normal(0.5, 0.03, seeds)  # the seed effect shared by every arm

    def cell(shift, noise=0.01):
        return {s: _Run(base[s] + shift + rng.normal(0, noise)) for s in range(seeds)}

    def on_policy(sign):  # one update: the runs differ by rounding-sized, mean-zero noise
        return {s: _Run(base[s] + sign * 0.002 * (-1) ** s) for s in range(seeds)}
    return {"reinforce": {0: on_policy(1), 8: cell(-0.20)},
            "ppo": {0: on_policy(-1), 8: cell(0.0)},
            "tis": {0: on_policy(0), 8: cell(-0.10)},
            "gspo": {0: cell(0.05), 8: cell(0.04)},
            "vcpo": {0: on_policy(1), 8: cell(-0.05)},
            "decoupled_ppo (minibatches=4)": {0: {s: _Run(base[s], mb=4) for s in range(seeds)}}}


def test_families_adjust_within_each_family_and_the_null_control_passes():
    grid, fn = _grid(), (lambda r: r.acc)
    null = protocol.null_control(grid, fn)
    # gspo and vcpo (its OPOB baseline) are different updates on-policy; a 4-minibatch arm
    # of the PPO family is a null arm of its own setting, paired with none of the others
    assert protocol.null_arms(grid) == ["decoupled_ppo (minibatches=4)", "ppo", "reinforce",
                                        "tis"]
    assert len(null) == 3 and not any(r["significant"] for r in null)
    assert all("minibatches" not in r["a"] + r["b"] for r in null)
    cost = protocol.staleness_cost(grid, fn, ["reinforce", "ppo", "tis"], [8])
    assert [r["a"] for r in cost] == ["reinforce", "ppo", "tis"]
    assert [r["significant"] for r in cost] == [True, False, True]
    for r in cost:  # Holm over the family's three tests
        assert r["p"] <= r["p_holm"] <= min(1.0, 3 * r["p"]) + 1e-15
        assert r["half"] > 0 and math.isfinite(r["mde"])
        assert r["mde_family"] == pytest.approx(protocol.mde(r["sd"], r["n"], alpha=0.05 / 3))
        assert r["mde_family"] > r["mde"]
    vs = protocol.versus_reference(grid, fn, ["reinforce", "ppo", "tis"], [8])
    assert [r["a"] for r in vs] == ["reinforce", "tis"] and all(r["b"] == "ppo" for r in vs)
    text = protocol.family_markdown(cost)
    assert "p (Holm)" in text and "2 significant after Holm" in text


def test_at_several_minibatches_only_the_ppo_family_is_null():
    """The 4-minibatch grid (`:mb4`): ppo, decoupled_ppo and staleness_clip are one update at
    lag 0 (tests/learner/test_null_update.py checks it through the train step); reinforce
    and tis are not, and an arm whose lag-0 runs mix minibatch counts is no null arm."""
    rng = np.random.default_rng(2)
    base = rng.uniform(0.3, 0.6, 12)

    def cell(mb, shift=0.0):
        return {s: _Run(base[s] + shift + rng.normal(0, 0.002), mb=mb) for s in range(12)}
    mixed = cell(4)
    mixed[0] = _Run(base[0], mb=1)
    grid = {a: {0: cell(4)} for a in ("ppo", "decoupled_ppo", "staleness_clip", "reinforce",
                                      "tis")}
    grid["icepop"] = {0: mixed}
    assert protocol.null_arms(grid) == ["decoupled_ppo", "ppo", "staleness_clip"]
    null = protocol.null_control(grid, lambda r: r.acc)
    assert len(null) == 3 and not any(r["significant"] for r in null)


def test_a_post_hoc_contrast_is_the_paired_t_test_of_its_per_seed_combination():
    """`contrast` over an interaction (arm x lag), against scipy on the per-seed values, over
    the seeds every term has; `parse_contrast` reads the report's --posthoc strings."""
    grid, fn = _grid(), (lambda r: r.acc)
    del grid["ppo"][8][3]  # a seed one term lacks drops out of the contrast
    terms = protocol.parse_contrast("vcpo@8 - vcpo@0 - ppo@8 + ppo@0")
    assert terms == [(1, "vcpo", 8), (-1, "vcpo", 0), (-1, "ppo", 8), (1, "ppo", 0)]
    row = protocol.contrast(grid, fn, terms)
    seeds = [s for s in range(8) if s != 3]
    d = [grid["vcpo"][8][s].acc - grid["vcpo"][0][s].acc - grid["ppo"][8][s].acc
         + grid["ppo"][0][s].acc for s in seeds]
    assert row["n"] == 7 and row["diff"] == pytest.approx(np.mean(d))
    assert row["p"] == pytest.approx(sps.ttest_1samp(d, 0).pvalue)
    lo, hi = sps.t.interval(0.95, 6, loc=np.mean(d), scale=sps.sem(d))
    assert row["diff"] - row["half"] == pytest.approx(lo)
    assert row["diff"] + row["half"] == pytest.approx(hi)
    # two terms are the families' paired comparison
    pair = protocol.staleness_cost(grid, fn, ["tis"], [8])[0]
    two = protocol.contrast(grid, fn, protocol.parse_contrast("tis@8-tis@0"))
    assert two["diff"] == pair["diff"] and two["p"] == pair["p"]
    assert protocol.contrast(grid, fn, [(1, "absent", 8), (-1, "ppo", 8)]) is None
    for bad in ("vcpo-ppo@0", "vcpo@x", ""):
        with pytest.raises(ValueError, match="contrast"):
            protocol.parse_contrast(bad)
