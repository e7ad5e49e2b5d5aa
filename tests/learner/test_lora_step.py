"""LoRA through the real jitted train step (learner/train_step.py): only the adapters get
gradients and optimizer state, the base comes out bit-identical, the first step's loss is
the base model's (B = 0), and the 8-device mesh trains the same adapters as one device."""
import jax
import numpy as np
import pytest

from pipelinerl_jax import sharding
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.learner import batching, loop, train_step as ts
from pipelinerl_jax.models import LoRASpec, adapter_params, base_params, flat_params
from pipelinerl_jax.run_config import base_config
from tests.learner.step_testlib import MODEL, _rollouts

SPEC = LoRASpec(rank=4, alpha=8.0)
LENGTHS = [5, 9, 3, 12, 7, 2, 10, 6]


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _run(mesh_shape, lora, steps=3):
    cfg = base_config()
    cfg.learner.optimizer.learning_rate = 1e-2
    mesh = sharding.make_mesh(mesh_shape)
    model = create_model(MODEL, mesh, seed=3, lora=lora)
    start = flat_params(model)
    optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    opt_leaves, opt_bytes = len(jax.tree.leaves(state.opt_state)), _nbytes(state.opt_state)
    step_fn = loop.make_step(cfg, model, optimizer, mesh, state)
    packed = batching.pack(_rollouts(LENGTHS), 0, num_seqs=len(LENGTHS), chunks=1,
                           pack_len=32, completion_len=24, row_divisor=4)
    losses = []
    for _ in range(steps):
        state, metrics = step_fn(state, packed.arrays)
        assert float(metrics["skipped"]) == 0.0
        losses.append(float(metrics["loss"]))
    return dict(start=start, state=state, losses=losses, opt_leaves=opt_leaves,
                opt_bytes=opt_bytes, model=model)


@pytest.fixture(scope="module")
def one_device():
    return _run((1, 1, 1), SPEC), _run((1, 1, 1), None)


def test_only_adapters_train_and_hold_optimizer_state(one_device):
    lora, full = one_device
    state = lora["state"]
    trained = flat_params(state.params)
    frozen = flat_params(state.frozen)
    assert set(trained) == set(adapter_params(lora["start"]))
    assert set(frozen) == set(base_params(lora["model"])) == set(flat_params(full["state"].params))
    for name, w in frozen.items():  # several updates later, bit for bit
        np.testing.assert_array_equal(w, lora["start"][name], err_msg=name)
    for name, w in trained.items():
        assert not np.array_equal(w, lora["start"][name]), f"{name} did not train"
    # the first loss is the base's: fresh adapters (B = 0) compute exactly the base model
    assert lora["losses"][0] == pytest.approx(full["losses"][0], abs=1e-6)
    assert lora["losses"][-1] != full["losses"][-1]
    # AdamW's moments mirror the adapters only: two float32 copies of them, plus scalars
    adapter_bytes = sum(np.asarray(w, np.float32).nbytes for w in trained.values())
    moments = [x for x in jax.tree.leaves(lora["state"].opt_state) if x.ndim]
    assert len(moments) == 2 * len(trained)
    assert sum(x.nbytes for x in moments) == 2 * adapter_bytes
    ratio = lora["opt_bytes"] / full["opt_bytes"]
    held = _nbytes(state.params) + _nbytes(state.frozen) + lora["opt_bytes"]
    held_full = _nbytes(full["state"].params) + full["opt_bytes"]
    print(f"\noptimizer state: LoRA {lora['opt_bytes']} B in {lora['opt_leaves']} leaves vs "
          f"full {full['opt_bytes']} B in {full['opt_leaves']} leaves (ratio {ratio:.4f}); "
          f"learner params + optimizer state ratio {held / held_full:.4f}")
    assert ratio < 0.25


def test_eight_device_mesh_trains_the_same_adapters(eight_devices, one_device):
    lora, _ = one_device
    got = _run((2, 2, 2), SPEC)
    state = got["state"]
    P = jax.sharding.PartitionSpec
    q_a = state.params["layers"][0]["attn"]["q_proj_lora_a"]
    q_b = state.params["layers"][0]["attn"]["q_proj_lora_b"]
    assert q_a.sharding.spec == P("fsdp") and q_b.sharding.spec == P(None, "tensor")
    assert len(q_a.sharding.device_set) == 8
    np.testing.assert_allclose(got["losses"], lora["losses"], rtol=1e-4, atol=1e-5)
    # Adam divides by sqrt(v): a reduction order's 1e-7 in a near-zero gradient can move an
    # element by ~1e-4 of the ~3e-2 that three steps at lr 1e-2 move it
    ref = flat_params(lora["state"].params)
    moved = max(float(np.max(np.abs(w - lora["start"][k]))) for k, w in ref.items())
    assert moved > 1e-2
    for name, w in flat_params(state.params).items():
        np.testing.assert_allclose(w, ref[name], rtol=0, atol=5e-4, err_msg=name)
    for name, w in flat_params(state.frozen).items():
        np.testing.assert_array_equal(w, got["start"][name], err_msg=name)


def test_checkpoints_hold_only_adapters_and_resume_exactly(tmp_path, one_device):
    """A LoRA checkpoint holds the adapters, their optimizer state and the step (no base:
    a restart loads the init checkpoint again); restored into a fresh state over the same
    base, the next step is bit-identical to the uninterrupted run's."""
    from pipelinerl_jax.learner.checkpoint import Checkpointer
    cfg = base_config()
    cfg.learner.optimizer.learning_rate = 1e-2
    mesh = sharding.make_mesh((1, 1, 1))
    packed = batching.pack(_rollouts(LENGTHS), 0, num_seqs=len(LENGTHS), chunks=1,
                           pack_len=32, completion_len=24, row_divisor=4)

    def fresh():
        model = create_model(MODEL, mesh, seed=3, lora=SPEC)
        optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
        state = ts.init_state(model, optimizer, mesh)
        return state, loop.make_step(cfg, model, optimizer, mesh, state)

    state, step_fn = fresh()
    for _ in range(2):
        state, _ = step_fn(state, packed.arrays)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(2, ts.checkpointed(state), {"version": 2})
    ckpt.wait()
    saved_bytes = _nbytes(ckpt.read_state(2)[0])
    assert saved_bytes == _nbytes(ts.checkpointed(state))
    assert saved_bytes < _nbytes(state.frozen) / 2  # the base is not in it
    state, _ = step_fn(state, packed.arrays)  # the uninterrupted run's third step
    want = flat_params(state.params)

    again, again_fn = fresh()
    saved, meta, step, _ = ckpt.restore(ts.checkpointed(again))
    ckpt.close()
    again = ts.restored(again, saved)
    assert isinstance(again, ts.LoRATrainState) and step == 2 and int(again.step) == 2
    again, _ = again_fn(again, packed.arrays)
    for name, w in flat_params(again.params).items():
        np.testing.assert_array_equal(w, want[name], err_msg=name)
    print(f"\nLoRA checkpoint {saved_bytes} B; the frozen base it leaves out "
          f"{_nbytes(state.frozen)} B")
