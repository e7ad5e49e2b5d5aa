"""The learner's train step as a run config builds it: the loss's resolved hyperparameters
and declared needs decide it, never the raw `loss` section (whose unset keys are None)."""
import jax
import numpy as np
import pytest

from pipelinerl_jax import sharding
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.learner import batching, loop, train_step as ts
from pipelinerl_jax.losses import LOSSES, get_loss, loss_from_config
from pipelinerl_jax.models import tiny_config
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.types import Rollout

VOCAB = 40
MODEL = tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4,
                    num_kv_heads=2, head_dim=16)


def _rollouts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Rollout(prompt_ids=rng.integers(3, VOCAB, 4).astype(np.int32),
                    completion_ids=rng.integers(3, VOCAB, c).astype(np.int32),
                    logp_behaviour=-rng.uniform(0.5, 4.0, c).astype(np.float32),
                    version=np.zeros(c, np.int32), kv_version=np.zeros(c, np.int32),
                    reward=float(i % 2), advantage=float(rng.normal()),
                    group_id=f"g-{i // 4}", group_size=4)
            for i, c in enumerate(lengths)]


def _train(cfg, rollouts, steps=2):
    mesh = sharding.make_mesh((1, 1, 1))
    model = create_model(MODEL, mesh, seed=3)
    optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    step_fn = loop.make_step(cfg, model, optimizer, mesh, state)
    chunks = cfg.learner.minibatches * cfg.learner.micro_batches
    packed = batching.pack(rollouts, 0, num_seqs=len(rollouts), chunks=chunks, pack_len=32,
                           completion_len=24)
    losses = []
    for _ in range(steps):
        state, metrics = step_fn(state, packed.arrays)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses, packed


def test_default_loss_config_accumulates_micro_batches_by_tokens():
    """Regression: with no `loss.agg` set the loss aggregates by `token_mean` (the
    registry's default), so micro-batches must be weighted by their tokens: 2 micro-batches
    with unequal token counts give exactly the 1-micro-batch update."""
    cfg = base_config()
    cfg.learner.optimizer.learning_rate = 1e-4
    assert cfg.loss.agg is None and loss_from_config(cfg.loss).hparams["agg"] == "token_mean"
    rollouts = _rollouts([20, 18, 22, 19, 3, 2, 4, 1])  # chunk 1: 79 tokens, chunk 2: 10
    one_params, one_losses, _ = _train(cfg, rollouts)
    cfg.learner.micro_batches = 2
    two_params, two_losses, packed = _train(cfg, rollouts)
    tokens = packed.arrays["loss_mask"].sum(axis=(1, 2))
    assert tokens[0] != tokens[1]
    np.testing.assert_allclose(two_losses, one_losses, atol=1e-6, rtol=0)
    for a, b in zip(jax.tree.leaves(one_params), jax.tree.leaves(two_params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_recompute_proximal_auto_reads_what_the_loss_declares(name):
    loss_fn = get_loss(name)
    declared = name in ("decoupled_ppo", "icepop", "staleness_clip")
    assert loss_fn.needs_proximal is declared
    assert loop.uses_proximal("auto", loss_fn) is declared
    assert loop.uses_proximal(True, loss_fn) and not loop.uses_proximal(False, loss_fn)
