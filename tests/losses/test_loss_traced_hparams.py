"""Numeric loss hyperparameters are traced inputs: one compiled loss serves every value, and
the traced loss equals the loss built with those values as constants."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.losses import LOSSES, get_loss

from tests.losses.losses_testlib import make_inputs, to_jax

# Per loss: two settings of every numeric hyperparameter it takes (non-defaults included),
# the structural ones fixed. kl_coef > 0 needs reference log-probs (extras).
SETTINGS = {
    "reinforce": ({"kl_coef": 0.1}, {"kl_coef": 0.3}),
    "ppo": ({"eps_low": 0.1, "eps_high": 0.3, "dual_clip": 3.0, "kl_coef": 0.05},
            {"eps_low": 0.25, "eps_high": 0.15, "dual_clip": 1.5, "kl_coef": 0.2}),
    "tis": ({"cap": 1.5}, {"cap": 4.0}),
    "decoupled_ppo": ({"eps_low": 0.1, "eps_high": 0.2, "behave_cap": 2.0},
                      {"eps_low": 0.3, "eps_high": 0.4, "behave_cap": 1.2}),
    "icepop": ({"band_low": 0.6, "band_high": 3.0}, {"band_low": 0.3, "band_high": 8.0}),
    "staleness_clip": ({"alpha": 0.5, "cap": 2.0, "lag_cutoff": 6},
                       {"alpha": 0.2, "cap": 1.3, "lag_cutoff": 9}),
    "cispo": ({"eps_low": 0.2, "eps_high": 2.0}, {"eps_low": 0.5, "eps_high": 5.0}),
    "gspo": ({"eps_low": 3e-4, "eps_high": 4e-4}, {"eps_low": 0.5, "eps_high": 1.0}),
    "m2po": ({"tau": 0.04}, {"tau": 0.3}),
    "m2po_released": ({"form": "released", "tau": 0.01, "floor_low": 0.0, "floor_high": 0.0},
                      {"form": "released", "tau": 0.05, "floor_low": 0.1, "floor_high": 0.2}),
    "seq_is": ({"high": 1.5, "low": 0.8, "veto": 0.3, "mode": "mask"},
               {"high": 3.0, "low": 0.5, "veto": 0.1, "mode": "mask"}),
    "opsm": ({"delta": 0.0, "eps_high": 0.3}, {"delta": 0.2, "eps_high": 0.1}),
    "a3po": ({"behave_cap": 1.2}, {"behave_cap": 3.0}),
    "vcpo": ({"cap": 1.5, "ess_base": 0.9}, {"cap": 8.0, "ess_base": 0.3}),
}


def test_every_loss_has_settings():
    assert {k.split("_released")[0] for k in SETTINGS} == set(LOSSES)


def _flat(out):
    (loss, metrics), grad = out
    return {"loss": loss, "grad": grad, **metrics}


@pytest.mark.parametrize("key", sorted(SETTINGS))
def test_traced_hyperparameters_share_one_compilation_and_equal_constants(key):
    name = key.split("_released")[0]
    a, b = SETTINGS[key]
    built = get_loss(name, diagnostics=False, **a)
    assert {k for k, v in a.items() if not isinstance(v, str)} <= set(built.traced_hparams)
    inputs = to_jax(make_inputs(seed=1, extras=True))

    def grad_of(loss_fn, hp):
        return jax.value_and_grad(lambda lp: loss_fn(inputs._replace(logp=lp), hp),
                                  has_aux=True)(inputs.logp)

    traced = jax.jit(lambda hp: grad_of(built, hp))
    results = []
    for setting in (a, b):
        hp = {k: jnp.float32(v) for k, v in get_loss(name, **setting).traced_hparams.items()}
        got = _flat(traced(hp))
        want = _flat(jax.jit(lambda: grad_of(get_loss(name, diagnostics=False, **setting),
                                             None))())
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-6,
                                       rtol=1e-6, err_msg=f"{name} {setting} {k}")
        results.append(got)
    assert traced._cache_size() == 1  # the second setting reused the first's executable
    # The values are used, not ignored: the two settings give different gradients.
    assert not np.allclose(np.asarray(results[0]["grad"]), np.asarray(results[1]["grad"]))


def test_structural_hyperparameters_are_not_traced():
    loss_fn = get_loss("staleness_clip", schedule="exp", alpha=0.5)
    assert "schedule" not in loss_fn.traced_hparams and "agg" not in loss_fn.traced_hparams
    assert "lag_cutoff" not in loss_fn.traced_hparams  # unset (None): structural
    assert loss_fn.traced_hparams["alpha"] == 0.5
    with pytest.raises(ValueError, match="not traced hyperparameters"):
        loss_fn(to_jax(make_inputs()), {"schedule": 1.0})
