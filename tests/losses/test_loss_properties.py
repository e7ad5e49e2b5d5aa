"""Properties a user relies on: on-policy invariances, masking, finiteness on extreme inputs,
one compilation per shape, m2po's exact drop rule under ties, and input contract errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses_reference as ref
from losses_testlib import B, T, compiled, make_inputs, run, run_many, to_jax, traces
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.losses import LOSSES, LossInputs, get_loss
from pipelinerl_jax.losses.policy import m2po_keep

CORRECTIONS = ("ppo", "tis", "decoupled_ppo", "icepop", "staleness_clip", "cispo", "m2po")


def _on_policy(seed=10, **kw):
    inputs = make_inputs(seed=seed, **kw)
    inputs["logp_behaviour"] = inputs["logp"].copy()
    if inputs["logp_proximal"] is not None:
        inputs["logp_proximal"] = inputs["logp"].copy()
    return inputs


@pytest.mark.parametrize("proximal", [True, False])
def test_on_policy_gradient_is_the_policy_gradient(proximal):
    results = run_many([(name, {}) for name in ("reinforce",) + CORRECTIONS],
                       _on_policy(proximal=proximal))
    want = results[0][1]
    assert np.abs(want).max() > 1e-2
    for name, (_, grad) in zip(CORRECTIONS, results[1:]):
        np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_staleness_clip_caps_stale_behaviour_weights_where_decoupled_ppo_does_not():
    """At the learner's minibatches=1 the proximal policy is the current one (r = 1): there
    decoupled_ppo is uncapped IS against μ, while staleness_clip caps each token's weight at
    1 + (cap-1)·s(lag), so the two differ as soon as a stale token's weight passes its cap."""
    inputs = make_inputs(seed=11, extras=True)  # extras: the pytree other tests compile for
    inputs["logp_proximal"] = inputs["logp"].copy()  # what the train step does at minibatches=1
    inputs["lag"] = np.full_like(inputs["lag"], 4)
    w = np.exp(inputs["logp"] - inputs["logp_behaviour"])
    trained = inputs["loss_mask"] > 0
    assert (w[trained] > 1 + 1 / 3).any()  # cap at lag 4: 1 + 1/(1+0.5·4)
    loss_d, metrics_d, grad_d = run("decoupled_ppo", inputs, diagnostics=True)
    loss_s, metrics_s, grad_s = run("staleness_clip", inputs, diagnostics=True)
    assert not np.allclose(grad_s, grad_d)
    assert float(metrics_s["clip_frac"]) > 0 and float(metrics_d["clip_frac"]) == 0
    # The capped weight is exactly the bound: the gradient of a capped token is the bound
    # times reinforce's, uncapped tokens keep decoupled_ppo's.
    _, _, grad_r = run("reinforce", inputs)
    capped = trained & (w > 1 + 1 / 3)
    np.testing.assert_allclose(grad_s[capped], (1 + 1 / 3) * grad_r[capped], rtol=1e-5)
    np.testing.assert_allclose(grad_s[trained & ~capped], grad_d[trained & ~capped], rtol=1e-5)
    # Staler tokens get a tighter cap, so (weights above every cap) less weight.
    inputs["lag"] = np.full_like(inputs["lag"], 16)
    _, _, grad_16 = run("staleness_clip", inputs)
    assert np.abs(grad_16).sum() < np.abs(grad_s).sum()


def test_staleness_clip_without_proximal_is_tis_with_the_lag_cap():
    inputs = make_inputs(seed=12, proximal=False)
    inputs["lag"] = np.zeros_like(inputs["lag"])
    loss_s, _, grad_s = run("staleness_clip", inputs, cap=1.7)
    loss_t, _, grad_t = run("tis", inputs, cap=1.7)
    np.testing.assert_allclose(grad_s, grad_t, rtol=1e-6, atol=1e-8)


def test_tis_with_cap_below_every_ratio_ignores_the_ratios():
    cap = 0.05
    a, b = make_inputs(seed=12), make_inputs(seed=12)
    b["logp_behaviour"] = b["logp"] - np.random.default_rng(0).uniform(-2.9, 2.0, (B, T))
    for inputs in (a, b):
        assert np.all(np.exp(inputs["logp"] - inputs["logp_behaviour"]) > cap)
    loss_a, _, grad_a = run("tis", a, cap=cap)
    loss_b, _, grad_b = run("tis", b, cap=cap)
    _, _, reinforce = run("reinforce", a)
    assert loss_a == loss_b
    np.testing.assert_array_equal(grad_a, grad_b)
    np.testing.assert_allclose(grad_a, cap * reinforce, rtol=1e-6)


def _garbage_where_masked(inputs, seed):
    rng = np.random.default_rng(seed)
    out = dict(inputs)
    off = inputs["loss_mask"] == 0
    for key, junk in (("logp", -np.inf), ("logp_behaviour", np.nan), ("logp_proximal", np.inf),
                      ("advantages", np.nan), ("logp_ref", -np.inf), ("entropy", np.nan)):
        out[key] = np.where(off, junk, inputs[key])
    out["lag"] = np.where(off, rng.integers(-5, 10**6, (B, T)), inputs["lag"])
    out["loss_mask"] = np.where(off, -rng.uniform(0, 1, (B, T)), inputs["loss_mask"])
    return out


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_tokens_change_nothing_and_get_no_gradient(name):
    inputs = make_inputs(seed=13, extras=True)
    loss, metrics, grad = run(name, inputs, diagnostics=True)
    compiled_once = traces(name, diagnostics=True)  # the session's (other tests' shapes too)
    loss_g, metrics_g, grad_g = run(name, _garbage_where_masked(inputs, 13), diagnostics=True)
    assert loss_g == loss
    np.testing.assert_array_equal(grad_g, grad)
    assert np.all(grad[inputs["loss_mask"] == 0] == 0)
    for key in metrics:
        np.testing.assert_array_equal(metrics_g[key], metrics[key], err_msg=key)
    assert traces(name, diagnostics=True) == compiled_once  # the garbage batch: no retrace


def _extreme_inputs(seed):
    rng = np.random.default_rng(seed)
    choice = lambda *v: rng.choice(np.array(v), (B, T))  # noqa: E731
    inputs = make_inputs(seed=seed, extras=True)
    inputs["logp"] = choice(-1e-7, -0.3, -55.0, -90.0)
    inputs["logp_behaviour"] = choice(-1e-6, -2.0, -60.0, -100.0)
    inputs["logp_proximal"] = choice(-1e-8, -70.0, -1.0)
    inputs["logp_ref"] = choice(-1e-8, -80.0)
    inputs["advantages"] = choice(-1e4, 0.0, 3e3)
    inputs["entropy"] = choice(0.0, 12.0)
    return inputs


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_output_is_finite_on_extreme_inputs(name):
    inputs = _extreme_inputs(14)
    compiled_once = None
    for batch in (inputs, dict(inputs, loss_mask=np.zeros((B, T), np.float32))):
        loss, metrics, grad = run(name, batch, diagnostics=True)
        compiled_once = compiled_once or traces(name, diagnostics=True)
        assert np.isfinite(loss) and np.all(np.isfinite(grad)), name
        for key, value in metrics.items():
            assert np.all(np.isfinite(value)), key
    # The all-masked batch trains nothing.
    assert loss == 0 and np.all(grad == 0) and metrics["tokens"] == 0
    assert traces(name, diagnostics=True) == compiled_once  # the masked batch: no retrace


def test_a_jitted_step_compiles_once_per_shape():
    """(The step is the session's: other tests may have compiled it for other shapes first.)"""
    step = compiled("ppo", diagnostics=True)
    jax.block_until_ready(step(to_jax(make_inputs(seed=20, extras=True))))
    once, programs = traces("ppo", diagnostics=True), step._cache_size()
    for seed in range(1, 3):
        jax.block_until_ready(step(to_jax(make_inputs(seed=20 + seed, extras=True))))
    assert traces("ppo", diagnostics=True) == once
    assert step._cache_size() == programs


@pytest.fixture(scope="module")
def jitted_m2po_keep():
    return jax.jit(m2po_keep)  # tau traced: one compilation for every tau


@pytest.mark.parametrize("seed", range(4))
def test_m2po_drops_the_fewest_largest_even_with_ties(jitted_m2po_keep, seed):
    rng = np.random.default_rng(seed)
    d = np.round(rng.normal(0, 0.4, (B, T)) * 4) / 4  # quantised log-ratios: many ties
    trained = rng.uniform(size=(B, T)) < 0.8
    d2 = np.where(trained, d * d, 0.0).astype(np.float32)
    for tau in (0.01, 0.04, 0.1, 0.3):
        want = ref._m2po_keep(d2.astype(np.float64), trained, tau)
        got = np.asarray(jitted_m2po_keep(jnp.asarray(d2), jnp.asarray(trained),
                                          jnp.float32(tau)))
        np.testing.assert_array_equal(got, want, err_msg=f"tau={tau}")


def test_mismatched_shapes_name_the_field():
    inputs = to_jax(make_inputs(seed=0))
    bad = inputs._replace(advantages=inputs.advantages[:, :3])
    with pytest.raises(ValueError, match="LossInputs.advantages"):
        get_loss("ppo")(bad)
    with pytest.raises(ValueError, match=r"LossInputs.logp: must be \[B, T\]"):
        get_loss("ppo")(LossInputs(*(a[0] for a in inputs[:6])))


def test_kl_coef_without_reference_logprobs_fails():
    with pytest.raises(ConfigError, match="loss.kl_coef"):
        get_loss("tis", kl_coef=0.1)(to_jax(make_inputs(seed=0)))


def test_explicitly_sharded_batch_matches_the_reference(eight_devices):
    """Rows sharded over 8 devices (the learner's data-parallel layout, explicit sharding):
    loss, gradient and diagnostics equal the unsharded float64 reference."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    parts = [make_inputs(seed=seed, extras=True) for seed in (30, 31)]
    inputs = {k: np.concatenate([p[k] for p in parts])[:8] for k in parts[0]}
    batch = jax.device_put(to_jax(inputs), jax.NamedSharding(mesh, jax.P("data")))
    loss_fn = get_loss("m2po", tau=0.1)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(
        lambda lp, b: loss_fn(b._replace(logp=lp)), has_aux=True))(batch.logp, batch)
    assert grad.sharding.spec == jax.P("data", None)
    want_loss, want_grad = ref.loss_and_grad("m2po", {"tau": 0.1}, inputs)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
    t = inputs["loss_mask"] > 0
    d = inputs["logp"] - inputs["logp_behaviour"]
    want = ref.diagnostics(inputs, masked=t & ~ref._m2po_keep(np.where(t, d * d, 0), t, 0.1))[0]
    for key in ("ess", "seq_ess", "kl_k3", "masked_frac", "r_max", "entropy", "tokens"):
        np.testing.assert_allclose(float(metrics[key]), want[key], rtol=1e-4, err_msg=key)
