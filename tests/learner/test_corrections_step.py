"""The sequence-level corrections through the jitted train step the learner runs, at
minibatches 1 and 2, against their float64 oracles (tests/losses/corrections_reference.py).

The oracle gets the model's own log-probs (a separate forward pass of the same tiny model) and
returns the loss and d loss / d logp; the expected parameter gradient is that cotangent pulled
back through the model. The step's reported loss and gradient norm must match (at minibatches
2: the mean over the two updates, the second taken at the parameters after the first, which a
one-minibatch step on the first half reproduces). Then each correction is shown to differ
from its nearest existing loss on stale data, and to equal it where theory says it must.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.losses import loss_from_config
from tests.learner.step_testlib import _rollouts, max_diff, one_step, param_delta
from tests.learner.test_staleness_clip_step import _cfg
from tests.losses import corrections_reference as oracle

LAG = 4


def _batch(minibatches, lag=LAG):
    """Rollouts sampled at version 0 (behaviour log-probs not the model's), trained at
    version `lag`; advantages of both signs."""
    rollouts = [dataclasses.replace(r, version=np.zeros_like(r.version),
                                    kv_version=np.zeros_like(r.kv_version))
                for r in _rollouts([20, 18, 22, 19, 12, 9, 14, 11], seed=1)]
    return batching.pack(rollouts, lag, num_seqs=len(rollouts), chunks=minibatches,
                         pack_len=32, completion_len=24).arrays


_CHUNK_KEYS = ("input_ids", "positions", "segment_ids", "targets", "gather_idx")


def _logp(graphdef, params, input_ids, positions, segment_ids, targets, gather_idx):
    """The model's log-probs of one chunk's sequences, [N, C]."""
    model = nnx.merge(graphdef, params)
    logits = model(input_ids, positions=positions, segment_ids=segment_ids)
    lp, _ = ts.logp_and_entropy(logits, targets, 1.0)
    return jnp.take(lp.reshape(-1), gather_idx)


# Jitted (the graphdef static), so every oracle check compiles them once, not op by op.
_logp_jit = jax.jit(_logp, static_argnums=0)
_pullback_grad = jax.jit(jax.grad(
    lambda params, dlogp, graphdef, *chunk: jnp.sum(dlogp * _logp(graphdef, params, *chunk))),
    static_argnums=2)


def _oracle_minibatch(name, hp, graphdef, arrays, chunk, params, params0, proximal):
    """(loss, gradient norm) of one update on chunk `chunk` at `params`, by the oracle."""
    inputs = [jnp.asarray(arrays[k][chunk]) for k in _CHUNK_KEYS]
    logp = np.asarray(_logp_jit(graphdef, params, *inputs), np.float64)
    prox = np.asarray(_logp_jit(graphdef, params0, *inputs), np.float64) if proximal else None
    a = {k: arrays[k][chunk] for k in ("logp_behaviour", "advantages", "loss_mask", "lag")}
    loss, dlogp = oracle.loss_and_grad(name, hp, logp, a["logp_behaviour"], prox,
                                       a["advantages"], a["loss_mask"], a["lag"])
    grads = _pullback_grad(params, jnp.asarray(dlogp, jnp.float32), graphdef, *inputs)
    return loss, float(optax.global_norm(grads))


# Every correction at minibatches 1 and 2 (seq_is: its masked geometric form at one of them).
CASES = [("seq_is", {"level": "geometric", "mode": "mask", "high": 1.3}, 1), ("seq_is", {}, 2),
         ("opsm", {"delta": 0.0}, 1), ("opsm", {"delta": 0.0}, 2), ("a3po", {}, 1),
         ("a3po", {}, 2), ("vcpo", {"baseline": "none"}, 1), ("vcpo", {"baseline": "none"}, 2)]
# (VCPO with its off-policy optimal baseline: tests/losses/test_vcpo_baseline.py.)


@pytest.mark.parametrize("name,hp,minibatches", CASES)
def test_train_step_matches_the_oracle(name, hp, minibatches):
    cfg = _cfg(name, minibatches, **hp)
    proximal = loss_from_config(cfg.loss).needs_proximal
    arrays = _batch(minibatches)
    params0, _, metrics, graphdef = one_step(cfg, arrays)
    params = [params0]
    if minibatches == 2:  # the parameters the second update starts from
        params.append(one_step(_cfg(name, 1, **hp), {k: v[:1] for k, v in arrays.items()})[1])
    want = [_oracle_minibatch(name, hp, graphdef, arrays, k, params[k], params0, proximal)
            for k in range(minibatches)]
    np.testing.assert_allclose(metrics["loss"], np.mean([w[0] for w in want]), rtol=2e-4,
                               atol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], np.mean([w[1] for w in want]), rtol=2e-3)
    assert metrics["skipped"] == 0


def test_corrections_differ_from_their_nearest_loss_on_stale_data():
    """At minibatches=1 (where the learner's proximal policy is the current one)."""
    arrays = _batch(1)
    moved = {}
    for key, name, hp in [("seq_is", "seq_is", {}),
                          ("token_is", "decoupled_ppo", {"behave_cap": 2.0}),
                          ("opsm", "opsm", {"delta": 0.0}), ("ppo", "ppo", {}),
                          ("a3po", "a3po", {}), ("decoupled_ppo", "decoupled_ppo", {})]:
        before, after, _, _ = one_step(_cfg(name, 1, **hp), arrays)
        moved[key] = param_delta(before, after)
    for a, b in [("seq_is", "token_is"), ("opsm", "ppo"), ("a3po", "decoupled_ppo"),
                 ("a3po", "ppo")]:
        assert max_diff(moved[a], moved[b]) > 1e-5, (a, b)


def test_corrections_equal_their_nearest_loss_where_theory_says():
    """At minibatches=2 (the proximal policy recomputed for the decoupled losses)."""
    arrays, fresh = _batch(2), _batch(2, lag=1)  # a3po: α = 0 at lag <= 1

    def moved(name, batch, **hp):
        before, after, _, _ = one_step(_cfg(name, 2, **hp), batch)
        return param_delta(before, after)

    pairs = [(moved("seq_is", arrays, level="token", high=1.5),
              moved("decoupled_ppo", arrays, behave_cap=1.5)),
             (moved("opsm", arrays, delta=1e6), moved("ppo", arrays)),
             (moved("a3po", fresh), moved("ppo", fresh))]
    for a, b in pairs:
        assert max_diff(a, b) < 1e-6


def test_vcpo_scales_the_step_of_sequence_tis_by_its_ess():
    """At minibatches=1 VCPO's gradient is sequence TIS's at the same cap; the update (AdamW's,
    weight decay included) is that update times sqrt(ESS/B) of the sequence weights."""
    arrays = _batch(1)
    before, after, metrics, _ = one_step(_cfg("vcpo", 1, cap=2.0, baseline="none"), arrays)
    _, tis_after, _, _ = one_step(_cfg("tis", 1, level="sequence", cap=2.0), arrays)
    scale = float(metrics["step_scale"])
    assert 0.05 < scale < 0.95
    vcpo_moved, tis_moved = param_delta(before, after), param_delta(before, tis_after)
    scaled = jax.tree.map(lambda t: scale * t, tis_moved)
    # The same gradient by two float paths: Adam's first update (~lr·g/|g|) magnifies the
    # rounding of near-zero gradients (~3e-6 here) against a whole step (~1e-3).
    step = max_diff(tis_moved, jax.tree.map(np.zeros_like, tis_moved))
    assert max_diff(vcpo_moved, scaled) < 1e-2 * step
    assert max_diff(vcpo_moved, tis_moved) > 0.05 * step
