"""Mesh sharding on 8 fake CPU devices: specs follow the rules, results follow the math."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from pipelinerl_jax import sharding
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.models import from_pretrained, save_pretrained, tiny_config

pytestmark = pytest.mark.usefixtures("eight_devices")  # fails, never skips, on fewer


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh((2, 2, 2))


@pytest.fixture(scope="module")
def sharded_model(mesh):
    return create_model(tiny_config(tie_word_embeddings=False), mesh, seed=7)


def test_parameters_carry_rule_shardings(sharded_model):
    m = sharded_model
    assert m.embed[...].sharding.spec == P("tensor", "fsdp")
    assert m.lm_head[...].sharding.spec == P("fsdp", "tensor")
    attn = m.layers[0].attn
    assert attn.q_proj[...].sharding.spec == P("fsdp", "tensor")
    assert attn.k_proj[...].sharding.spec == P("fsdp", "tensor")
    assert attn.o_proj[...].sharding.spec == P("tensor", None, "fsdp")
    assert m.layers[1].mlp.gate_proj[...].sharding.spec == P("fsdp", "tensor")
    assert m.layers[1].mlp.down_proj[...].sharding.spec == P("tensor", "fsdp")
    assert m.final_norm.weight[...].sharding.spec == P()
    # Really split: a device holds a quarter of the (fsdp x tensor)-sharded embedding.
    shard = m.embed[...].addressable_shards[0].data
    assert shard.shape == (m.cfg.vocab_size // 2, m.cfg.hidden_size // 2)


def test_sharded_forward_equals_single_device(sharded_model, mesh):
    ids = np.random.default_rng(0).integers(0, 64, (8, 12)).astype(np.int32)
    graphdef, state = nnx.split(sharded_model)
    host_state = jax.device_get(state)  # the same values, copied to host, then to one device
    single = nnx.merge(graphdef, jax.device_put(host_state, jax.devices()[0]))
    assert len(single.embed[...].sharding.device_set) == 1
    ref = np.asarray(nnx.jit(lambda m, x: m(x))(single, jnp.asarray(ids)))

    @nnx.jit
    def fwd(model, x):
        return model(x)

    out = fwd(sharded_model, jax.device_put(ids, sharding.batch_sharding(mesh)))
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_from_pretrained_places_into_mesh(sharded_model, mesh, tmp_path):
    save_pretrained(sharded_model, str(tmp_path))
    loaded = from_pretrained(str(tmp_path), mesh=mesh)
    assert loaded.layers[0].mlp.up_proj[...].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(np.asarray(loaded.embed[...]),
                                  np.asarray(sharded_model.embed[...]))


def test_mesh_that_does_not_divide_fails_clearly():
    cfg = tiny_config(num_heads=6, num_kv_heads=3, head_dim=16)  # 3 kv heads over tensor=2
    with pytest.raises(sharding.ShardingError, match=r"k_proj.*dim 1 \(size 3\)"):
        create_model(cfg, sharding.make_mesh((2, 2, 2)))


def test_mesh_larger_than_devices_fails():
    with pytest.raises(sharding.ShardingError, match="needs 64 devices"):
        sharding.make_mesh((4, 4, 4))


def test_batch_divisor(mesh):
    assert sharding.batch_divisor(mesh) == 4
    assert sharding.logical_to_spec(("batch", "seq")) == P(("data", "fsdp"))
