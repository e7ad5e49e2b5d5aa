"""Every loss, in every aggregation mode, against the independent float64 NumPy reference:
value and gradient w.r.t. logp (rtol 1e-4), with and without a proximal policy, plus the KL
penalty and the diagnostics."""
import numpy as np
import pytest

import losses_reference as ref
from losses_testlib import make_inputs, run, run_many
from pipelinerl_jax.losses import LAG_BUCKETS, flatten_metrics

AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
SWEPT = ("reinforce", "ppo", "tis", "decoupled_ppo", "icepop", "staleness_clip", "cispo", "m2po")
VARIANTS = [
    ("ppo", {"eps_low": 0.1, "eps_high": 0.3, "dual_clip": 1.2}),
    ("tis", {"cap": 1.3, "level": "sequence"}),
    ("tis", {"cap": 0.9}),
    ("decoupled_ppo", {"behave_cap": 1.5}),
    ("icepop", {"band_low": 0.7, "band_high": 1.4, "eps_high": 0.3}),
    ("staleness_clip", {"schedule": "exp", "alpha": 0.5, "lag_cutoff": 6}),
    ("staleness_clip", {"schedule": "constant", "lag_cutoff": 3, "agg": "seq_mean_token_mean"}),
    ("staleness_clip", {"cap": 1.2, "alpha": 2.0, "eps_high": 0.1}),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.3}),
    ("gspo", {}),
    ("gspo", {"eps_low": 0.2, "eps_high": 0.3}),
    ("m2po", {"tau": 0.5}),
    ("m2po", {"form": "released"}),
    ("m2po", {"form": "released", "tau": 0.02, "floor_low": 0.0, "floor_high": 0.0}),
    ("m2po", {"form": "released", "tau": 0.02, "floor_low": 0.3, "floor_high": 0.5}),
    ("m2po", {"form": "released", "tau": 50.0}),
]
NO_PROXIMAL = ("ppo", "decoupled_ppo", "icepop", "staleness_clip", "cispo", "gspo")


def _agg_hparams(agg):
    return {"agg": agg, "max_tokens": 16} if agg == "constant" else {"agg": agg}


def _check(name, hparams, inputs):
    loss, _, grad = run(name, inputs, **hparams)
    want_loss, want_grad = ref.loss_and_grad(name, hparams, inputs)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    return want_grad


@pytest.mark.parametrize("name", SWEPT)
def test_every_aggregation_matches_reference(name):
    inputs = make_inputs(seed=1)
    configs = [(name, _agg_hparams(agg)) for agg in AGGS]
    for (_, hparams), (loss, grad) in zip(configs, run_many(configs, inputs)):
        want_loss, want_grad = ref.loss_and_grad(name, hparams, inputs)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-4, atol=1e-6, err_msg=str(hparams))
        np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6, err_msg=str(hparams))
        assert np.abs(want_grad).max() > 1e-3  # the case is not degenerate


@pytest.mark.parametrize("name,hparams", VARIANTS, ids=[f"{n}-{h}" for n, h in VARIANTS])
def test_hyperparameter_variants_match_reference(name, hparams):
    grad = _check(name, hparams, make_inputs(seed=2))
    assert np.abs(grad).max() > 1e-3 or name == "gspo"


@pytest.mark.parametrize("name", NO_PROXIMAL)
def test_without_proximal_policy_matches_reference(name):
    hparams = {"eps_low": 0.2, "eps_high": 0.3} if name == "gspo" else {}
    _check(name, hparams, make_inputs(seed=3, proximal=False))


@pytest.mark.parametrize("name,estimator", [("ppo", "k1"), ("ppo", "k2"), ("ppo", "k3"),
                                            ("gspo", "k3"), ("tis", "k2")])
def test_kl_penalty_matches_reference(name, estimator):
    hparams = {"kl_coef": 0.3, "kl_estimator": estimator}
    inputs = make_inputs(seed=4, extras=True)
    _check(name, hparams, inputs)
    # The penalty really is there: without it the loss differs.
    assert run(name, inputs, **hparams)[0] != pytest.approx(run(name, inputs)[0], rel=1e-3)


@pytest.mark.parametrize("name,hparams", [(n, {}) for n in SWEPT + ("gspo",)] + VARIANTS[:3])
def test_reference_gradient_is_its_finite_difference(name, hparams):
    """The hand-written reference gradients agree with central differences of the reference
    value (sg quantities frozen), so the reference is not just the JAX code restated."""
    inputs = make_inputs(seed=5)
    _, grad = ref.loss_and_grad(name, hparams, inputs)
    h = 1e-6
    numeric = np.zeros_like(grad)
    for idx in zip(*np.nonzero(inputs["loss_mask"])):
        up, down = dict(inputs), dict(inputs)
        up["logp"], down["logp"] = inputs["logp"].copy(), inputs["logp"].copy()
        up["logp"][idx] += h
        down["logp"][idx] -= h
        value_up = ref.loss_and_grad(name, hparams, up, frozen=inputs["logp"])[0]
        value_down = ref.loss_and_grad(name, hparams, down, frozen=inputs["logp"])[0]
        numeric[idx] = (value_up - value_down) / (2 * h)
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)


def _check_diagnostics(metrics, want_overall, want_buckets):
    flat = flatten_metrics(metrics)
    for key, want in want_overall.items():
        np.testing.assert_allclose(flat[key], want, rtol=1e-4, atol=1e-6, err_msg=key)
    for bucket, stats in want_buckets.items():
        for key, want in stats.items():
            np.testing.assert_allclose(flat[f"lag_{bucket}/{key}"], want, rtol=1e-4, atol=1e-6,
                                       err_msg=f"lag_{bucket}/{key}")


@pytest.mark.parametrize("proximal", [True, False])
def test_ppo_diagnostics_match_reference(proximal):
    inputs = make_inputs(seed=6, proximal=proximal, extras=True)
    _, metrics, _ = run("ppo", inputs, diagnostics=True)
    old = inputs["logp_proximal"] if proximal else inputs["logp_behaviour"]
    r = np.exp(inputs["logp"] - old)
    overall, buckets = ref.diagnostics(inputs, clip_low=r < 0.8, clip_high=r > 1.2)
    assert overall["clip_frac"] > 0 and 0 < overall["ess"] < 1
    _check_diagnostics(metrics, overall, buckets)
    assert metrics["lag/tokens"][LAG_BUCKETS.index("2")] == 0  # the empty bucket reads 0
    assert np.all(metrics["lag/ess"][LAG_BUCKETS.index("2")] == 0)
    if not proximal:
        assert metrics["w_mean"] == metrics["w_min"] == metrics["w_max"] == 1.0
    for key in ("abs_mean", "abs_max", "frac_above_0.1", "kl_k3"):  # lag 0: the mismatch
        np.testing.assert_allclose(metrics[f"mismatch/{key}"], buckets["0"][f"mismatch_{key}"],
                                   rtol=1e-4, atol=1e-6)


def test_the_mismatch_is_reported_per_engine():
    """Lag-0 tokens of two engines: each engine's mismatch is its own tokens' (the oracle's
    lag-0 statistics over them), named by the batch's engine ids once flattened."""
    inputs = make_inputs(seed=8, extras=True, lag_max=1)
    engine = np.zeros_like(inputs["lag"])
    engine[1::2] = 1
    _, metrics, _ = run("ppo", dict(inputs, engine=engine), diagnostics=True)
    flat = flatten_metrics(metrics, ("jax-0", "sglang-0"))
    t = inputs["loss_mask"] > 0
    for index, name in enumerate(("jax-0", "sglang-0")):
        rows = (engine == index)
        sub = dict(inputs, loss_mask=np.where(rows, inputs["loss_mask"], 0.0))
        want = ref.diagnostics(sub)[1]["0"]
        assert flat[f"engine_{name}/tokens"] == np.sum(t & rows & (inputs["lag"] == 0)) > 0
        for key in ("abs_mean", "abs_max", "frac_above_0.1", "kl_k3"):
            np.testing.assert_allclose(flat[f"engine_{name}/mismatch_{key}"],
                                       want[f"mismatch_{key}"], rtol=1e-4, atol=1e-6)
    assert not any(k.startswith("engine/") for k in flat)


def test_m2po_and_icepop_report_what_they_masked():
    inputs = make_inputs(seed=7, extras=True)
    t = inputs["loss_mask"] > 0
    d = inputs["logp"] - inputs["logp_behaviour"]
    dropped = t & ~ref._m2po_keep(np.where(t, d * d, 0.0), t, 0.15)
    _, metrics, _ = run("m2po", inputs, diagnostics=True, tau=0.15)
    _check_diagnostics(metrics, *ref.diagnostics(inputs, masked=dropped))
    assert 0 < metrics["masked_frac"] < 1
    assert metrics["m2po_d2_mean_kept"] <= 0.15 < metrics["m2po_d2_mean"]

    w = np.exp(inputs["logp_proximal"] - inputs["logp_behaviour"])
    _, metrics, _ = run("icepop", inputs, diagnostics=True)
    want = ref.diagnostics(inputs, masked=(w < 0.5) | (w > 5.0))[0]["masked_frac"]
    assert 0 < metrics["masked_frac"] == pytest.approx(want)
