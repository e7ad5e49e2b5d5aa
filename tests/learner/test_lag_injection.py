"""Lag injection's bookkeeping: which version's params the learner ships as each version."""
import ml_collections
import numpy as np

from pipelinerl_jax.lag_injection import LagInjector, injected_lag


def _inj(kind="fixed", k=2, max_k=2, seed=0):
    return ml_collections.ConfigDict(dict(enabled=True, kind=kind, k=k, max_k=max_k, seed=seed))


def test_fixed_lag_ships_version_minus_k_and_keeps_only_max_k_back():
    inj = LagInjector(_inj(k=2, max_k=2))
    shipped = [inj.ship(v, {"w": np.full(2, float(v))}) for v in range(6)]
    assert [pv for pv, _ in shipped] == [0, 0, 0, 1, 2, 3]  # min(k, step) in the first k
    assert [float(p["w"][0]) for _, p in shipped] == [0, 0, 0, 1, 2, 3]
    assert sorted(inj.history) == [3, 4, 5]


def test_a_restored_history_ships_what_an_uninterrupted_run_would():
    straight = LagInjector(_inj(k=2, max_k=2))
    for v in range(4):
        straight.ship(v, {"w": np.full(2, float(v))})
    restored = LagInjector(_inj(k=2, max_k=2), history=dict(straight.history))
    a, b = straight.ship(4, {"w": np.full(2, 4.0)}), restored.ship(4, {"w": np.full(2, 4.0)})
    assert a[0] == b[0] == 2 and np.array_equal(a[1]["w"], b[1]["w"])


def test_drawn_lags_are_deterministic_and_bounded():
    for kind in ("uniform", "geometric"):
        cfg = _inj(kind=kind, k=2, max_k=4, seed=7)
        lags = [injected_lag(cfg, s) for s in range(200)]
        assert lags == [injected_lag(cfg, s) for s in range(200)]
        assert all(0 <= k <= min(4, s) for s, k in enumerate(lags)) and len(set(lags)) > 1
