"""The learner's train step as a run config builds it: the loss's resolved hyperparameters
and declared needs decide it, never the raw `loss` section (whose unset keys are None)."""
import jax
import numpy as np
import pytest

from pipelinerl_jax.learner import loop
from pipelinerl_jax.losses import LOSSES, get_loss, loss_from_config
from pipelinerl_jax.run_config import base_config
from tests.learner.step_testlib import _rollouts, _train

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
    declared = name in ("decoupled_ppo", "icepop", "staleness_clip", "seq_is", "vcpo")
    assert loss_fn.needs_proximal is declared
    assert loop.uses_proximal("auto", loss_fn) is declared
    assert loop.uses_proximal(True, loss_fn) and not loop.uses_proximal(False, loss_fn)
