"""VCPO's off-policy optimal baseline (OPOB, `loss.baseline`) through the jitted train step the
learner runs, against a float64 oracle that takes each sequence's gradient norm another way.

The step takes the norms from one packed forward and a `vjp` per sequence; the oracle runs the
tiny model on each sequence alone (unpacked) and takes `jax.grad` of its summed log-prob (the
model computes in float32; everything after the norms is float64 NumPy). From those it forms
each group's baseline from the formula (losses/vcpo.py), subtracts it from the advantages and
hands them to VCPO's float64 oracle (corrections_reference.py); the expected parameter
gradient is that cotangent pulled back through the unpacked model. Scope: the part of each
group inside one minibatch, across its micro-batches (the groups here interleave, so every
micro-batch and minibatch holds part of both).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.losses import get_loss, loss_from_config
from pipelinerl_jax.models.factory import create_model
from tests.learner.step_testlib import MODEL, _rollouts, max_abs, max_diff, one_step, param_delta
from tests.learner.test_staleness_clip_step import _cfg
from tests.losses import corrections_reference as oracle

LAG = 4
LENGTHS = [20, 18, 22, 19, 12, 9, 14, 11]


def _model():
    mesh = sharding.make_mesh((1, 1, 1))
    return mesh, create_model(MODEL, mesh, seed=3)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _seq_logp(graphdef, params, seq, p):
    n = seq.shape[0]
    logits = nnx.merge(graphdef, params)(seq[None], positions=jnp.arange(n)[None],
                                         segment_ids=jnp.ones((1, n), jnp.int32))
    lp, _ = ts.logp_and_entropy(logits, jnp.append(seq[1:], 0)[None], 1.0)
    return lp[0, p - 1:n - 1]


def _row_logp(graphdef, params, r):
    """log π_θ of rollout `r`'s completion tokens, the model run on `r` alone: [C] (jitted
    per sequence length: run op by op, the oracle took ~90 s of compiles)."""
    seq = np.concatenate([r.prompt_ids, r.completion_ids]).astype(np.int32)
    return _seq_logp(graphdef, params, jnp.asarray(seq), len(r.prompt_ids))


def _rollouts_for(interleave=True, spread=0.15, identical=False):
    """Rollouts sampled at version 0 whose behaviour log-probs are the initial model's plus
    noise (sequence weights of order 1, some past a cap of 2), in two groups of four."""
    rs = _rollouts(LENGTHS, seed=1)
    if identical:  # every member of a group the same sequence: equal weights and norms
        rs = [dataclasses.replace(rs[4 * (i // 4)], advantage=rs[i].advantage)
              for i in range(len(rs))]
    _, model = _model()
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(7)
    out = []
    for i, r in enumerate(rs):
        lp = np.asarray(_row_logp(graphdef, params, r), np.float32)
        noise = 0.0 if identical else rng.normal(0.0, spread, lp.shape)
        out.append(dataclasses.replace(
            r, logp_behaviour=(lp + noise).astype(np.float32),
            version=np.zeros_like(r.version), kv_version=np.zeros_like(r.kv_version),
            group_id=f"g-{i % 2 if interleave else i // 4}"))
    return out


def _cfg_of(baseline, minibatches, micro_batches=1, **hp):
    cfg = _cfg("vcpo", minibatches, baseline=baseline, **hp)
    cfg.learner.micro_batches = micro_batches
    return cfg


def _pack(rollouts, chunks):
    return batching.pack(rollouts, LAG, num_seqs=len(rollouts), chunks=chunks, pack_len=32,
                         completion_len=24).arrays


def _oracle_baselines(sq_norm, log_w, adv, groups, cap, form):
    """b_g = Σ λ_i A_i / Σ λ_i over each group, λ_i = s_i·W_i²(·min(W_i, cap)² for 'opob')."""
    w = np.exp(log_w)
    lam = sq_norm * w ** 2 * (np.minimum(w, cap) ** 2 if form == "opob" else 1.0)
    b = np.zeros_like(adv)
    for g in set(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        b[idx] = np.sum(lam[idx] * adv[idx]) / np.sum(lam[idx])
    return b


def _oracle_minibatch(form, hp, graphdef, rows, params, params0, minibatches):
    """(loss, gradient norm, baselines) of one update on `rows` (rollouts) at `params`."""
    C = 24
    n = len(rows)
    m = np.zeros((n, C))
    logp, prox, mu, adv = (np.zeros((n, C)) for _ in range(4))
    sq = np.zeros(n)
    for i, r in enumerate(rows):
        c = len(r.completion_ids)
        m[i, :c] = 1.0
        logp[i, :c] = np.asarray(_row_logp(graphdef, params, r), np.float64)
        prox[i, :c] = (np.asarray(_row_logp(graphdef, params0, r), np.float64)
                       if minibatches > 1 else logp[i, :c])
        mu[i, :c] = r.logp_behaviour
        adv[i, :c] = r.advantage
        grads = jax.grad(lambda p, r=r: jnp.sum(_row_logp(graphdef, p, r)))(params)
        sq[i] = sum(np.sum(np.square(np.asarray(g, np.float64)))
                    for g in jax.tree.leaves(grads))
    log_w = np.clip((m * (prox - mu)).sum(axis=1), -20, 20)
    cap = hp.get("cap", oracle.DEFAULTS["vcpo"]["cap"])
    b = _oracle_baselines(sq, log_w, adv[:, 0], [r.group_id for r in rows], cap, form)
    loss, dlogp = oracle.loss_and_grad("vcpo", hp, logp, mu, prox, adv - b[:, None], m,
                                       np.full((n, C), LAG))

    def pulled(p):
        return sum(jnp.sum(jnp.asarray(dlogp[i, :len(r.completion_ids)], jnp.float32)
                           * _row_logp(graphdef, p, r)) for i, r in enumerate(rows))
    return loss, float(optax.global_norm(jax.grad(pulled)(params))), b


CASES = [("opob", 1, 1, {}), ("opob", 2, 1, {}), ("opob", 1, 2, {}),
         ("opob", 1, 1, {"cap": 2.0}), ("opob_eq", 1, 1, {"cap": 2.0})]


@pytest.mark.parametrize("form,minibatches,micro_batches,hp", CASES)
def test_train_step_matches_the_oracle(form, minibatches, micro_batches, hp):
    rollouts = _rollouts_for()
    arrays = _pack(rollouts, minibatches * micro_batches)
    params0, _, metrics, graphdef = one_step(_cfg_of(form, minibatches, micro_batches, **hp),
                                          arrays)
    per = len(rollouts) // minibatches
    params = [params0]
    if minibatches == 2:  # the parameters the second update starts from
        first = _pack(rollouts[:per], micro_batches)
        params.append(one_step(_cfg_of(form, 1, micro_batches, **hp), first)[1])
    want = [_oracle_minibatch(form, hp, graphdef, rollouts[k * per:(k + 1) * per], params[k],
                              params0, minibatches) for k in range(minibatches)]
    baselines = np.concatenate([w[2] for w in want])
    assert np.min(np.abs(baselines)) > 1e-3  # the baseline moves every row here
    np.testing.assert_allclose(metrics["vcpo_baseline_abs"], np.mean(np.abs(baselines)),
                               rtol=2e-4)
    np.testing.assert_allclose(metrics["loss"], np.mean([w[0] for w in want]), rtol=2e-4,
                               atol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], np.mean([w[1] for w in want]), rtol=2e-3)
    assert metrics["skipped"] == 0


def test_baseline_changes_the_update_where_it_should():
    """Unequal norms and weights: each form moves the parameters differently from VCPO without
    a baseline, and the authors' form ('opob': min(W, cap)² W²) from the README's (W²) when
    weights pass the cap."""
    arrays = _pack(_rollouts_for(), 1)
    moved = {}
    for form in ("none", "opob", "opob_eq"):
        before, after, _, _ = one_step(_cfg_of(form, 1, cap=2.0), arrays)
        moved[form] = param_delta(before, after)
    step = max_abs(moved["none"])
    assert max_diff(moved["opob"], moved["none"]) > 0.05 * step
    assert max_diff(moved["opob_eq"], moved["none"]) > 0.05 * step
    assert max_diff(moved["opob"], moved["opob_eq"]) > 1e-3 * step


def test_baseline_is_the_plain_mean_with_equal_weights_and_norms():
    """Every member of a group the same sequence with the same behaviour log-probs (equal W
    and norms): the baseline is the group's mean advantage; with advantages centred per group
    it is zero and the update is VCPO's without it."""
    rollouts = _rollouts_for(interleave=False, identical=True)
    for g in range(2):  # centre each group's advantages
        members = rollouts[4 * g:4 * g + 4]
        mean = np.mean([r.advantage for r in members])
        rollouts[4 * g:4 * g + 4] = [dataclasses.replace(r, advantage=r.advantage - mean)
                                     for r in members]
    arrays = _pack(rollouts, 1)
    before, none, _, _ = one_step(_cfg_of("none", 1), arrays)
    _, opob, metrics, _ = one_step(_cfg_of("opob", 1), arrays)
    assert metrics["vcpo_baseline_abs"] < 1e-6
    assert max_diff(param_delta(before, opob), param_delta(before, none)) < 1e-4 * max_abs(
        param_delta(before, none))


def test_baseline_key_is_validated():
    with pytest.raises(ConfigError, match="loss.baseline"):
        get_loss("vcpo", baseline="mean")
    with pytest.raises(ConfigError, match="loss.baseline"):
        get_loss("ppo", baseline="opob")
    assert get_loss("vcpo").baseline == "opob"  # as the authors ran VCPO
    assert get_loss("ppo").baseline == "none"
    assert loss_from_config(_cfg_of("none", 1).loss).baseline == "none"
