"""The paged engine's programs compiled ahead of time for a TPU topology from this CPU host
(libtpu from PyPI: `pip install -e ".[tpu]"`): on a 2-way tensor mesh of a v5e:2x2 slice the
decode program calls the Pallas ragged paged attention kernel (a Mosaic custom call) per
shard, each shard's kernel reading its half of the pool's heads as stored. Fails, never
skips, without libtpu."""
import os

import jax
import pytest

from pipelinerl_jax import sharding
from pipelinerl_jax.models import tiny_config
from pipelinerl_jax.rollout.engine_programs import engine_programs
from pipelinerl_jax.rollout.jax_engine import engine_config

# explicit block sizes: the kernel's tuned table reads the default (CPU) device otherwise
BLOCKS = (("num_kv_pages_per_block", 2), ("num_queries_per_block", 8))


@pytest.fixture(scope="module")
def v5e():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # (other processes may hold it)
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    except Exception as e:  # noqa: BLE001 - reported with the fix, never skipped
        pytest.fail(f"no TPU topology from libtpu ({type(e).__name__}: {e}); install it with "
                    "pip install -e '.[tpu]'", pytrace=False)


def test_paged_decode_compiles_for_tpu_with_the_kernel_per_shard(v5e):
    cfg = engine_config()
    cfg.update(kv_layout="paged", page_size=16, max_slots=8, max_seq_len=64, dtype="bfloat16")
    mesh = sharding.make_mesh((1, 1, 2), v5e)
    with jax.default_device(v5e[0]):
        progs = engine_programs(tiny_config(), cfg, mesh, block_sizes=BLOCKS)
        assert progs.kernel.impl == "tpu_ragged" and progs.kernel.mesh is mesh
        # the pool as the kernel stores it: 2 kv heads -> 4 interleaved k/v, 128 lanes
        assert progs.cache.kv[0].shape == (32, 16, 4, 128)
        compiled = progs.fns.decode.lower(*progs.decode_args(8), cache_len=64,
                                          rows=8).compile()
    hlo = compiled.as_text()
    kernel = [line for line in hlo.splitlines()
              if "custom-call(" in line and "ragged_paged_attention" in line]
    assert kernel, "the decode program does not call the Pallas kernel"
    # per shard: 8 rows x (4 query heads / 2 shards) x 128 lanes
    assert all("bf16[8,2,128]" in line for line in kernel), kernel[0][:300]
    assert compiled.memory_analysis().argument_size_in_bytes > 0
