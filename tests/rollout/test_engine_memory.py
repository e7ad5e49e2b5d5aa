"""The engine's dense KV cache: its cost at real sizes and the start-up check."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.models import Decoder, ModelConfig, tiny_config
from pipelinerl_jax.rollout import engine_memory
from pipelinerl_jax.rollout.decode_step import init_engine_cache
from pipelinerl_jax.rollout.jax_engine import JaxEngine

# Qwen2.5-1.5B's config.json dimensions
QWEN_1_5B = ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                        num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                        model_type="qwen2", qkv_bias=True, tie_word_embeddings=True,
                        max_position_embeddings=32768)


def test_kv_bytes_are_the_allocated_cache():
    cfg = tiny_config()
    cache = init_engine_cache(cfg, 3, 64)
    allocated = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert engine_memory.kv_cache_bytes(cfg, 3, 64, jnp.float32) == allocated


def test_qwen_1_5b_4k_256_slots_does_not_fit_a_16_gib_chip():
    kv = engine_memory.kv_cache_bytes(QWEN_1_5B, 256, 4096, jnp.bfloat16)
    assert kv == 28 * 1024 * 256 * 4096  # 28 KiB per token: 28 GiB
    with pytest.raises(ConfigError) as e:
        engine_memory.check_fits(QWEN_1_5B, 256, 4096, jnp.bfloat16,
                                 jax.devices()[:1], available=16 << 30)
    msg = str(e.value)
    assert e.value.key == "engine.max_slots"
    assert "engine.max_seq_len=4096" in msg and "at most 105 slots fit" in msg
    ok = engine_memory.check_fits(QWEN_1_5B, 96, 4096, jnp.bfloat16, jax.devices()[:1],
                                  available=16 << 30)
    assert ok["kv_cache_bytes"] == 96 * 112 << 20  # 10.5 GiB


def test_engine_fails_at_start_up_without_allocating():
    model = Decoder(tiny_config(), nnx.Rngs(0))
    # 2·2 layers·2 kv heads·32·256 tokens·4 B = 256 KiB a slot: 10^7 slots = 2.4 TiB
    with pytest.raises(ConfigError, match=r"engine\.max_slots=10000000 x engine\.max_seq_len"):
        JaxEngine(model, {"max_slots": 10_000_000, "max_seq_len": 256})
