"""Learning rate, schedule and loss hyperparameters are traced inputs of the train step: runs
that differ only in them share one compiled executable, and the traced step equals the old
step that closed over them as constants."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.learner import loop, train_step as ts
from pipelinerl_jax.losses import get_loss
from pipelinerl_jax.run_config import base_config, optimizer_config

from tests.learner.test_train_step import CFG, _batch


def _constant_chain(cfg):
    """The optimizer as it was built before (every hyperparameter a closed-over constant)."""
    lr, warmup, total = cfg.learning_rate, cfg.warmup_steps, max(cfg.total_steps, 1)
    decay = {"cosine": lambda: optax.cosine_decay_schedule(lr, max(total - warmup, 1),
                                                           alpha=cfg.final_lr_ratio),
             "linear": lambda: optax.linear_schedule(lr, lr * cfg.final_lr_ratio,
                                                     max(total - warmup, 1)),
             "constant": lambda: optax.constant_schedule(lr)}[cfg.decay]()
    schedule = optax.join_schedules(
        [optax.linear_schedule(lr / max(warmup, 1), lr, warmup), decay], [warmup])
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                     optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    return tx, schedule


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_traced_schedule_equals_optax_schedule(decay, warmup):
    cfg = optimizer_config(learning_rate=3e-4, warmup_steps=warmup, total_steps=12,
                           decay=decay, final_lr_ratio=0.2)
    _, want = _constant_chain(cfg)
    _, got = ts.make_optimizer(cfg)
    for count in range(16):
        np.testing.assert_allclose(got(count), float(want(count)), rtol=1e-6, err_msg=count)


def _setup(opt, loss_fn, mesh):
    model = create_model(CFG, mesh, seed=3)
    state = ts.init_state(model, opt, mesh)
    step = ts.make_train_step(nnx.graphdef(model), opt, loss_fn, mesh=mesh,
                              state_sharding=ts.state_shardings(state))
    return state, step


def test_traced_step_equals_the_constant_closure_step():
    """Six updates on a fixed batch, through warmup and the whole cosine decay. (Adam turns
    last-ulp differences of near-zero gradients into differences of up to ~lr, so the two
    drift apart by ~lr/1000 after a few steps: 3e-7 at this lr, 5e-6 at lr=1e-2.)"""
    mesh = sharding.make_mesh((1, 1, 1))
    cfg = optimizer_config(learning_rate=1e-3, warmup_steps=2, total_steps=6, decay="cosine",
                           final_lr_ratio=0.1, weight_decay=0.01, max_grad_norm=0.5)
    loss_fn = get_loss("ppo", eps_low=0.1, eps_high=0.3, dual_clip=2.0)
    new_state, new_step = _setup(ts.make_optimizer(cfg)[0], loss_fn, mesh)
    old_state, old_step = _setup(ts.Optimizer(_constant_chain(cfg)[0]), loss_fn, mesh)
    constants = {"optimizer": {}, "loss": {}}  # nothing traced: the old, closed-over values
    assert new_step.hparams["loss"]["eps_low"].dtype == np.float32
    batch = _batch(mesh)
    for i in range(6):
        new_state, new_m = new_step(new_state, batch)
        old_state, old_m = old_step(old_state, batch, constants)
        for k in ("loss", "grad_norm", "clip_frac_low", "clip_frac_high"):
            if k in old_m:
                np.testing.assert_allclose(float(new_m[k]), float(old_m[k]), atol=1e-6,
                                           err_msg=f"step {i}: {k}")
    for a, b in zip(jax.tree.leaves(jax.device_get(new_state.params)),
                    jax.tree.leaves(jax.device_get(old_state.params))):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def _config(lr, warmup, eps_low):
    cfg = base_config()
    cfg.loss.name = "ppo"
    cfg.loss.eps_low = eps_low
    cfg.learner.optimizer.learning_rate = lr
    cfg.learner.optimizer.warmup_steps = warmup
    return cfg


def test_configs_differing_in_lr_and_loss_hyperparameters_share_one_executable():
    mesh = sharding.make_mesh((1, 1, 1))
    model = create_model(CFG, mesh, seed=3)
    steps = []
    for cfg in (_config(1e-4, 0, 0.2), _config(3e-3, 5, 0.1)):
        opt, _ = ts.make_optimizer(cfg.learner.optimizer)
        state = ts.init_state(model, opt, mesh)
        steps.append((loop.make_step(cfg, model, opt, mesh, state), opt))
    (a, opt), (b, _) = steps
    assert a.hparams["optimizer"]["learning_rate"] != b.hparams["optimizer"]["learning_rate"]
    batch = _batch(mesh)
    def fresh():  # the step donates its state, parameters included
        return ts.init_state(create_model(CFG, mesh, seed=3), opt, mesh)
    # Separately built steps (as in two runs of a sweep) lower to the same program, so XLA's
    # persistent compilation cache serves the second run the first run's executable.
    assert a.lower(fresh(), batch, a.hparams).as_text() == \
        b.lower(fresh(), batch, b.hparams).as_text()
    # One jitted step runs both configurations with one compilation ...
    state_a, m_a = a(fresh(), batch)
    state_b, m_b = a(fresh(), batch, b.hparams)
    assert a._cache_size() == 1
    # ... gives exactly what the other configuration's own step gives ...
    state_b2, m_b2 = b(fresh(), batch)
    for x, y in zip(jax.tree.leaves(jax.device_get(state_b.params)),
                    jax.tree.leaves(jax.device_get(state_b2.params))):
        np.testing.assert_array_equal(x, y)
    # ... and the values are used: the two configurations train differently.
    delta = [np.abs(np.asarray(x) - np.asarray(y)).max()
             for x, y in zip(jax.tree.leaves(jax.device_get(state_a.params)),
                             jax.tree.leaves(jax.device_get(state_b.params)))]
    assert max(delta) > 1e-6
