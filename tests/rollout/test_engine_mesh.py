"""The JaxEngine on a mesh of 8 fake CPU devices: what each device holds (weights by the
learner's rules, the KV cache on its kv heads, replicated scheduling state) and that it
samples exactly what the one-device engine samples; a weight update resharded from a learner
mesh; an engine mesh the heads cannot split is a config error naming the key.

(Provenance over a mesh — versions per token, in-flight updates — runs in
test_weight_updates.py's mesh layouts; the decode program compiled for a TPU topology, where
the Pallas kernel runs per shard under shard_map, in test_engine_programs_tpu.py.)"""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from pipelinerl_jax import sharding
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.models import flat_params, tiny_config
from pipelinerl_jax.rollout.engine_programs import engine_mesh, engine_programs
from pipelinerl_jax.rollout.jax_engine import engine_config
from tests.rollout.conftest import make_engine, random_requests, run_until

pytestmark = pytest.mark.usefixtures("eight_devices")  # fails, never skips, on fewer

PAGED = {"kv_layout": "paged", "page_size": 8}


def _greedy(eng, seed):
    reqs = random_requests(6, seed=seed, temperature=0.0)
    for r in reqs:
        eng.submit(r)
    return {c.request_id: c for c in run_until(eng, len(reqs))}


@pytest.mark.parametrize("layout,mesh", [
    (PAGED, (1, 1, 2)),  # kv heads split: one per shard
    (PAGED, (1, 1, 4)),  # tensor > kv heads: each shard stores a copy of its query heads' one
    (PAGED, (2, 2, 2)),  # data and fsdp too: weights split on embed, the rest replicated
    ({}, (1, 2, 4)),  # dense cache: split on kv heads... or not (4 > 2: replicated)
], ids=["paged-t2", "paged-t4", "paged-2x2x2", "dense-1x2x4"])
def test_mesh_engine_samples_what_one_device_samples(models, layout, mesh):
    one = make_engine(models[0], **layout)
    eng = make_engine(models[0], mesh=mesh, **layout)
    assert len(eng.programs.mesh.devices.flat) == int(np.prod(mesh))
    ref, got = _greedy(one, seed=3), _greedy(eng, seed=3)
    assert sorted(ref) == sorted(got)
    for rid, c in ref.items():
        np.testing.assert_array_equal(got[rid].token_ids, c.token_ids, err_msg=rid)
        np.testing.assert_allclose(got[rid].logp_behaviour, c.logp_behaviour, atol=1e-4)
    assert sum(len(c.token_ids) for c in ref.values()) > 30  # more than a token or two


def test_what_each_device_holds(models):
    """Tensor axis 4 over a model of 4 query and 2 kv heads, paged: q and MLP weights split
    four ways, k/v projections replicated (4 does not divide 2), the pool storing each kv
    head twice (K' = 4) so every device holds one head's keys and values; page tables and
    slot state replicated."""
    eng = make_engine(models[0], mesh=(1, 1, 4), **PAGED)
    params = flat_params(eng.params, host=False)
    assert params["layers/0/attn/q_proj"].sharding.spec == P("fsdp", "tensor")
    assert params["layers/0/attn/k_proj"].sharding.spec == P("fsdp")  # kv heads: replicated
    assert params["layers/0/mlp/gate_proj"].sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape[1] for s in params["layers/0/attn/q_proj"].addressable_shards} == {1}
    pool = eng.scheduler._cache.kv[0]
    cfg = models[0].cfg
    assert pool.shape[2:] == (2 * 4, cfg.head_dim)  # k, v of 4 stored heads, interleaved
    assert pool.sharding.spec == P(None, None, "tensor")
    assert {s.data.shape[2] for s in pool.addressable_shards} == {2}  # one head's k and v
    assert eng.scheduler._slots_dev.token.sharding.spec == P()
    # two kv heads over two devices: no copies, one head each
    eng2 = make_engine(models[0], mesh=(1, 1, 2), **PAGED)
    assert eng2.scheduler._cache.kv[0].shape[2] == 2 * cfg.num_kv_heads
    assert flat_params(eng2.params, host=False)["layers/0/attn/k_proj"].sharding.spec == P(
        "fsdp", "tensor")


def test_update_from_a_learner_mesh_lands_in_the_engine_layout(models):
    """The learner's params, sharded on its own mesh (fsdp 2 x tensor 2 over devices 4-7),
    installed in an engine on devices 0-3 (tensor 4): every array ends in the engine's
    sharding and the engine samples what a one-device engine given the same weights does."""
    learner_mesh = sharding.make_mesh((1, 2, 2), jax.devices()[4:8])
    graphdef, state = nnx.split(models[1])
    learner_state = jax.device_put(state, sharding.state_shardings(state, learner_mesh))
    eng = make_engine(models[0], mesh=(1, 1, 4), **PAGED)
    eng.update_weights(nnx.merge(graphdef, learner_state), 1)
    for (path, want), got in zip(
            jax.tree_util.tree_flatten_with_path(eng.programs.param_shardings)[0],
            jax.tree.leaves(eng.params)):
        assert got.sharding == want, path
    one = make_engine(models[1], **PAGED)
    ref, out = _greedy(one, seed=4), _greedy(eng, seed=4)
    for rid, c in ref.items():
        np.testing.assert_array_equal(out[rid].token_ids, c.token_ids, err_msg=rid)


def test_meshes_the_heads_cannot_split_name_the_key():
    cfg = engine_config()
    cfg.update(PAGED)
    with pytest.raises(ConfigError, match=r"^engine\.tensor_parallel:.*kv heads"):
        engine_programs(tiny_config(), cfg, sharding.make_mesh((1, 1, 3)))  # 3 vs K = 2
    with pytest.raises(ConfigError, match=r"^engine\.tensor_parallel:.*attention heads"):
        engine_programs(tiny_config(), cfg, sharding.make_mesh((1, 1, 8)))  # 8 vs H = 4
    with pytest.raises(ConfigError, match=r"^engine\.tensor_parallel:.*exceeds"):
        engine_mesh(9)
    assert engine_mesh(0).shape["tensor"] == 1  # CPU: one device (virtual devices share cores)
    assert engine_mesh(8).shape["tensor"] == 8
