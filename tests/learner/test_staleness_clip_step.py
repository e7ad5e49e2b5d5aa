"""staleness_clip through the train step the learner runs (not only the loss function).

At `minibatches=1` the train step sets the proximal policy to the current one, so the
proximal ratio is 1 and a clip on it never binds: the first staleness_clip (a lag-scaled clip
on that ratio) was `decoupled_ppo` bit for bit in every run of the staleness grid. These tests
drive the real jitted step with stale tokens (lag > 0) whose behaviour log-probs differ from
the model's, at minibatches 1 and 2, and check the loss acts: it differs from decoupled_ppo,
equals an independent oracle (token-level TIS with the lag's cap) at minibatches=1, and a
staler batch gets a smaller update.
"""
import dataclasses

import jax
import numpy as np
import pytest

from pipelinerl_jax.run_config import base_config
from tests.learner.step_testlib import _rollouts, _train


def _stale(lag, seed=0):
    """Rollouts sampled at version 0 whose behaviour log-probs (uniform in [-4, -0.5]) are not
    the model's; trained at learner version `lag`."""
    return [dataclasses.replace(r, version=np.zeros_like(r.version),
                                kv_version=np.zeros_like(r.kv_version))
            for r in _rollouts([20, 18, 22, 19, 12, 9, 14, 11], seed=seed)]


def _cfg(loss, minibatches, **hp):
    cfg = base_config()
    cfg.learner.optimizer.learning_rate = 1e-3
    cfg.learner.minibatches = minibatches
    cfg.loss.name = loss
    for k, v in hp.items():
        setattr(cfg.loss, k, v)
    return cfg


def _step(cfg, lag, monkeypatch):
    # The batch's lag is measured at the learner version `pack` is given: make it `lag`.
    from pipelinerl_jax.learner import batching
    pack = batching.pack
    monkeypatch.setattr(batching, "pack", lambda rs, _v, **kw: pack(rs, lag, **kw))
    params, losses, packed = _train(cfg, _stale(lag), steps=1)
    assert set(np.unique(packed.arrays["lag"][packed.arrays["loss_mask"] > 0])) == {lag}
    return params


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("lag", [4, 16])
def test_staleness_clip_is_not_decoupled_ppo_in_the_train_step(minibatches, lag, monkeypatch):
    clip = _step(_cfg("staleness_clip", minibatches), lag, monkeypatch)
    dppo = _step(_cfg("decoupled_ppo", minibatches), lag, monkeypatch)
    assert _max_diff(clip, dppo) > 1e-5


@pytest.mark.parametrize("lag", [4, 16])
def test_at_one_minibatch_it_is_tis_with_the_lag_cap(lag, monkeypatch):
    """Oracle: with every token at one lag, w' = min(π/μ, c(lag)) and r = 1, i.e. token TIS
    with cap c(lag) = 1 + (cap - 1)/(1 + alpha·lag)."""
    cap = 1.0 + 1.0 / (1.0 + 0.5 * lag)
    clip = _step(_cfg("staleness_clip", 1), lag, monkeypatch)
    tis = _step(_cfg("tis", 1, cap=cap), lag, monkeypatch)
    tis_default = _step(_cfg("tis", 1), lag, monkeypatch)
    # The same gradient by two float paths; Adam's first update (~lr·g/|g|) magnifies the
    # rounding of near-zero gradients to ~5e-6 here, against ~2e-3 (a whole step) for tis at
    # its default cap.
    assert _max_diff(clip, tis) < 1e-2 * _max_diff(clip, tis_default)


def test_m2po_forms_differ_in_the_train_step(monkeypatch):
    """The released form (budget over harmful tokens, one floored PPO clip) and the paper's
    masking form make different updates on the same stale batch."""
    paper = _step(_cfg("m2po", 1), 4, monkeypatch)
    released = _step(_cfg("m2po", 1, form="released"), 4, monkeypatch)
    assert _max_diff(paper, released) > 1e-5
