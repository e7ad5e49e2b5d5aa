"""bf16 parameters in the train step: float32 gradient accumulation, float32 Adam moments,
each update added in float32 and rounded once to bf16."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.losses import get_loss
from pipelinerl_jax.models import tiny_config
from pipelinerl_jax.run_config import optimizer_config
from pipelinerl_jax.records import Rollout

VOCAB = 40
DIMS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4,
            num_kv_heads=2, head_dim=16)


def _batch(mesh, seed):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(16):
        p, c = rng.integers(1, 9), rng.integers(1, 20)
        rows.append(Rollout(prompt_ids=rng.integers(3, VOCAB, p).astype(np.int32),
                            completion_ids=rng.integers(3, VOCAB, c).astype(np.int32),
                            logp_behaviour=-rng.uniform(0.5, 4.0, c).astype(np.float32),
                            version=np.zeros(c, np.int32), kv_version=np.zeros(c, np.int32),
                            reward=float(i % 2), advantage=float(rng.normal()),
                            group_id=f"g-{i // 4}", group_size=4))
    return batching.pack(rows, 0, num_seqs=16, chunks=2, pack_len=32, completion_len=20,
                         row_divisor=sharding.batch_divisor(mesh)).arrays


def _setup(model, mesh):
    opt, _ = ts.make_optimizer(optimizer_config(learning_rate=1e-2, total_steps=10))
    state = ts.init_state(model, opt, mesh)
    step = ts.make_train_step(nnx.graphdef(model), opt, get_loss("ppo"), mesh=mesh,
                              state_sharding=ts.state_shardings(state), micro_batches=2)
    return state, step


def test_bf16_params_train_with_float32_optimizer_state():
    mesh = sharding.make_mesh((1, 1, 1))
    model = create_model(tiny_config(param_dtype=jnp.bfloat16, **DIMS), mesh, seed=3)
    # Reference: float32 params holding the same (bf16-representable) values.
    ref_model = create_model(tiny_config(**DIMS), mesh, seed=3)
    nnx.update(ref_model, jax.tree.map(lambda x: x.astype(jnp.float32),
                                       nnx.state(model, nnx.Param)))
    state, step = _setup(model, mesh)
    ref_state, ref_step = _setup(ref_model, mesh)
    before = jax.device_get(state.params)

    state, metrics = step(state, _batch(mesh, 0))
    ref_state, ref_metrics = ref_step(ref_state, _batch(mesh, 0))
    # One step: the bf16 params are the float32 step's params rounded once to bf16 (the
    # gradients differ only by bf16 rounding; Adam's first update is about lr * sign(g)).
    got = np.concatenate([np.asarray(x, np.float32).ravel()
                          for x in jax.tree.leaves(jax.device_get(state.params))])
    want = np.concatenate([np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float32).ravel()
                           for x in jax.tree.leaves(jax.device_get(ref_state.params))])
    assert np.mean(got == want) > 0.99
    np.testing.assert_allclose(got, want, atol=2e-2)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-2)
    assert 0 <= float(metrics["update_rounded_away"]) < 0.05
    assert "update_rounded_away" not in ref_metrics  # float32 params: nothing rounds away

    state, metrics = step(state, _batch(mesh, 2))  # same row bucket as seed 0
    assert int(state.step) == 2 and float(metrics["skipped"]) == 0
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    after = jax.device_get(state.params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(after))
    changed = [np.mean(np.asarray(a, np.float32) != np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert min(changed) > 0.5, changed
    floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "nu"))
            if hasattr(s, "nu")]
    assert adam and all(x.dtype == jnp.float32
                        for s in adam for x in jax.tree.leaves((s.mu, s.nu)))
    assert step._cache_size() == 1  # the second step reused the compilation
