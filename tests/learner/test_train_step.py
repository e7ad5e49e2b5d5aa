"""Packing and the jitted, sharded train step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.run_config import optimizer_config
from pipelinerl_jax.learner import batching, train_step as ts
from pipelinerl_jax.losses import get_loss
from pipelinerl_jax.models import token_logprobs, tiny_config
from pipelinerl_jax.records import Rollout

VOCAB = 40
CFG = tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4,
                  num_kv_heads=2, head_dim=16)


def _rollouts(n, seed=0, max_prompt=9, max_completion=20):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = rng.integers(1, max_prompt), rng.integers(1, max_completion)
        out.append(Rollout(
            prompt_ids=rng.integers(3, VOCAB, p).astype(np.int32),
            completion_ids=rng.integers(3, VOCAB, c).astype(np.int32),
            logp_behaviour=-rng.uniform(0.5, 4.0, c).astype(np.float32),
            version=rng.integers(0, 3, c).astype(np.int32),
            kv_version=np.zeros(c, np.int32), reward=float(i % 2),
            advantage=float(rng.normal()), group_id=f"g-{i // 4}", group_size=4))
    return out


def test_row_bucket_and_first_fit():
    assert [batching.row_bucket(r, 1) for r in (1, 5, 8, 9, 13, 17)] == [1, 6, 8, 12, 16, 24]
    assert batching.row_bucket(5, 4) == 8
    bins = batching.first_fit_decreasing([5, 5, 4, 3, 3], 10)
    assert sorted(sum(([5, 5, 4, 3, 3][i] for i in b), 0) for b in bins) == [10, 10]
    with pytest.raises(ValueError, match="does not fit"):
        batching.first_fit_decreasing([11], 10)


def test_packed_logprobs_equal_separate_forwards():
    model = create_model(CFG, seed=1)
    rollouts = _rollouts(12)
    packed = batching.pack(rollouts, 5, num_seqs=16, chunks=2, pack_len=32, completion_len=20)
    a = packed.arrays
    assert a["input_ids"].shape[0] == 2 and a["loss_mask"].shape == (2, 8, 20)
    assert packed.num_tokens == sum(len(r.completion_ids) for r in rollouts)
    fwd = nnx.jit(lambda m, ids, pos, seg: m(ids, positions=pos, segment_ids=seg))
    # Reference: every sequence alone in its own right-padded row (plain causal forward).
    seqs = [np.concatenate([r.prompt_ids, r.completion_ids]) for r in rollouts]
    padded = np.zeros((len(seqs), 32), np.int32)
    for i, q in enumerate(seqs):
        padded[i, :len(q)] = q
    ref_all = np.asarray(token_logprobs(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(padded)),
                                        jnp.asarray(np.roll(padded, -1, axis=1))))
    for ch in range(2):
        logits = fwd(model, a["input_ids"][ch], a["positions"][ch], a["segment_ids"][ch])
        lp = np.asarray(token_logprobs(logits, jnp.asarray(a["targets"][ch]))).reshape(-1)
        gathered = lp[a["gather_idx"][ch]]
        for i, r in enumerate(rollouts[ch * 8:(ch + 1) * 8]):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            ref = ref_all[ch * 8 + i, p - 1:p - 1 + c]
            np.testing.assert_allclose(gathered[i, :c], ref, atol=1e-5)
            np.testing.assert_array_equal(a["lag"][ch, i, :c], 5 - r.version)
            assert a["loss_mask"][ch, i, c:].sum() == 0


def _step_setup(mesh, loss="ppo", micro_batches=1, minibatches=1, use_proximal=False):
    model = create_model(CFG, mesh, seed=3)
    opt, _ = ts.make_optimizer(optimizer_config(learning_rate=1e-2, total_steps=10))
    state = ts.init_state(model, opt, mesh)
    fn = ts.make_train_step(nnx.graphdef(model), opt, get_loss(loss), mesh=mesh,
                            state_sharding=ts.state_shardings(state),
                            micro_batches=micro_batches, minibatches=minibatches,
                            use_proximal=use_proximal)
    return state, fn


def _batch(mesh, chunks=1, seed=0):
    return batching.pack(_rollouts(16, seed), 2, num_seqs=16, chunks=chunks, pack_len=32,
                         completion_len=20, row_divisor=sharding.batch_divisor(mesh)).arrays


def test_sharded_step_equals_single_device(eight_devices):
    single_mesh, mesh = sharding.make_mesh((1, 1, 1)), sharding.make_mesh((2, 2, 2))
    s1, f1 = _step_setup(single_mesh)
    s8, f8 = _step_setup(mesh)
    assert s8.params["layers"][0]["mlp"]["up_proj"].sharding.spec == \
        jax.sharding.PartitionSpec("fsdp", "tensor")
    for _ in range(2):
        s1, m1 = f1(s1, _batch(single_mesh))
        s8, m8 = f8(s8, _batch(mesh))
    np.testing.assert_allclose(float(m1["loss"]), float(m8["loss"]), rtol=1e-4)
    # Adam normalises updates to ~lr (1e-2) per step, so summation-order noise in the
    # gradients shows up at ~1e-5 in a few parameters.
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s8.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    assert f8._cache_size() == 1  # second call reused the compilation


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    mesh = sharding.make_mesh((1, 1, 1))
    s1, f1 = _step_setup(mesh, loss="reinforce")
    s2, f2 = _step_setup(mesh, loss="reinforce", micro_batches=2)
    s1, m1 = f1(s1, _batch(mesh, chunks=1))
    s2, m2 = f2(s2, _batch(mesh, chunks=2))
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)  # see above


def test_minibatches_with_proximal_recompute_run_two_updates():
    mesh = sharding.make_mesh((1, 1, 1))
    state, fn = _step_setup(mesh, loss="decoupled_ppo", minibatches=2, use_proximal=True)
    state, metrics = fn(state, _batch(mesh, chunks=2))
    assert int(state.step) == 2 and float(metrics["skipped"]) == 0
    # The second minibatch sees a proximal policy one update behind the current one.
    assert float(metrics["r_max"]) > 1.0 or float(metrics["r_min"]) < 1.0


def test_non_finite_loss_skips_the_update():
    mesh = sharding.make_mesh((1, 1, 1))
    state, fn = _step_setup(mesh, loss="reinforce")
    before = jax.device_get(state.params)
    batch = _batch(mesh)
    batch["advantages"] = np.where(batch["loss_mask"] > 0, np.inf, 0).astype(np.float32)
    state, metrics = fn(state, batch)
    assert float(metrics["skipped"]) == 1 and int(state.step) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b)
    state, metrics = fn(state, _batch(mesh))  # a finite batch trains again
    assert float(metrics["skipped"]) == 0 and int(state.step) == 1
