"""The sequence-level corrections (seq_is, opsm, a3po, vcpo) against their independent float64
oracles (tests/losses/corrections_reference.py): value and gradient w.r.t. logp, with and
without a proximal policy, and the identities their sources imply."""
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.losses import get_loss
from tests.losses import corrections_reference as oracle
from tests.losses.losses_testlib import make_inputs, run

VARIANTS = [
    ("seq_is", {}),
    ("seq_is", {"level": "geometric", "mode": "mask", "high": 1.3}),
    ("seq_is", {"level": "geometric", "mode": "mask", "high": 1.5, "low": 0.9, "veto": 0.5}),
    ("seq_is", {"level": "sequence", "mode": "mask", "high": 3.0}),
    ("seq_is", {"level": "token", "mode": "truncate", "high": 1.2, "veto": 0.3}),
    ("opsm", {}),
    ("opsm", {"delta": 0.0, "eps_high": 0.3}),
    ("a3po", {}),
    ("a3po", {"behave_cap": 1.1}),
    ("vcpo", {}),
    ("vcpo", {"cap": 1.5, "ess_base": 0.5, "scaling": "linear"}),
]


def _oracle(name, hp, x):
    return oracle.loss_and_grad(name, hp, x["logp"], x["logp_behaviour"], x["logp_proximal"],
                                x["advantages"], x["loss_mask"], x["lag"])


@pytest.mark.parametrize("proximal", [True, False])
@pytest.mark.parametrize("name,hp", VARIANTS)
def test_matches_the_float64_oracle(name, hp, proximal):
    x = make_inputs(seed=2, proximal=proximal)
    loss, metrics, grad = run(name, x, **hp)
    want_loss, want_grad = _oracle(name, hp, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    if name == "vcpo":
        hp_all = {**oracle.DEFAULTS["vcpo"], **hp}
        m = np.where(x["loss_mask"] > 0, x["loss_mask"], 0.0)
        clean = lambda a: None if a is None else np.where(m > 0, a, 0.0)  # noqa: E731
        want = oracle.step_scale(hp_all, clean(x["logp"]), clean(x["logp_behaviour"]),
                                 clean(x["logp_proximal"]), m)
        assert 0.0 < want <= 1.0 and (hp or want < 1.0)
        np.testing.assert_allclose(metrics["step_scale"], want, rtol=1e-5)


def test_every_variant_acts():
    """Each variant changes the loss on these inputs: none is a silent no-op of its base."""
    x = make_inputs(seed=2)
    base = {name: run(name, x)[0] for name in oracle.DEFAULTS}
    for name, hp in VARIANTS:
        if hp:
            assert not np.isclose(run(name, x, **hp)[0], base[name], rtol=1e-6), (name, hp)


def _on_policy(x):
    """The sampler's log-probs equal the proximal ones (on-policy, no mismatch)."""
    return dict(x, logp_behaviour=x["logp_proximal"])


def test_on_policy_data_gives_ppo():
    """With μ = π_prox every weight is 1 and no KL can exceed δ: seq_is (any level, either
    mode) and opsm are PPO; a3po is PPO at any lag when μ = π_θ."""
    x = _on_policy(make_inputs(seed=3))
    ppo_loss, _, ppo_grad = run("ppo", x)
    for name, hp in [("seq_is", {}), ("seq_is", {"level": "geometric", "mode": "mask"}),
                     ("opsm", {})]:
        loss, _, grad = run(name, x, **hp)
        np.testing.assert_allclose(loss, ppo_loss, rtol=1e-6)
        np.testing.assert_allclose(grad, ppo_grad, rtol=1e-6, atol=1e-7)


def test_identities_with_the_nearest_existing_losses():
    x = make_inputs(seed=4)
    # Token-level truncated rollout IS is decoupled PPO with a behaviour cap.
    a = run("seq_is", x, level="token", high=1.5)
    b = run("decoupled_ppo", x, behave_cap=1.5)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-6, atol=1e-7)
    # ... and the sequence level is not.
    assert not np.isclose(run("seq_is", x)[0], run("decoupled_ppo", x, behave_cap=2.0)[0])
    # OPSM (its ratio against μ) with an unreachable δ is PPO against μ; with δ = 0 it masks.
    no_prox = dict(x, logp_proximal=None)
    np.testing.assert_allclose(run("opsm", x, delta=1e6)[0], run("ppo", no_prox)[0], rtol=1e-6)
    assert not np.isclose(run("opsm", x, delta=0.0)[0], run("ppo", no_prox)[0])
    # A-3PO ignores a proximal policy; at lags 0-1 (α = 0) it is PPO against μ.
    np.testing.assert_allclose(run("a3po", x)[0], run("a3po", no_prox)[0], rtol=1e-7)
    fresh = dict(no_prox, lag=np.minimum(x["lag"], 1))
    np.testing.assert_allclose(run("a3po", fresh)[0], run("ppo", fresh)[0], rtol=1e-6)
    assert not np.isclose(run("a3po", x)[0], run("decoupled_ppo", x)[0])
    # VCPO's gradient is sequence TIS's at the same cap when π_prox = π_θ (r = 1).
    np.testing.assert_allclose(run("vcpo", no_prox, cap=2.0)[2],
                               run("tis", no_prox, level="sequence", cap=2.0)[2],
                               rtol=1e-5, atol=1e-7)


def test_bad_hyperparameters_name_the_key():
    with pytest.raises(ConfigError, match="^loss.low"):
        get_loss("seq_is", low=0.5)  # only with mode='mask'
    with pytest.raises(ConfigError, match="^loss.high"):
        get_loss("seq_is", high=0.5)
    with pytest.raises(ConfigError, match="^loss.level"):
        get_loss("seq_is", level="row")
    with pytest.raises(ConfigError, match="^loss.ess_base"):
        get_loss("vcpo", ess_base=0.0)
    with pytest.raises(ConfigError, match="^loss.delta"):
        get_loss("opsm", delta=-1.0)
    assert get_loss("vcpo").scales_step and not get_loss("ppo").scales_step
    assert get_loss("seq_is").needs_proximal and not get_loss("a3po").needs_proximal
