"""A tiny LoRA decoder of each family with trained-looking adapters, for the PEFT tests."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelinerl_jax.models import Decoder, add_lora, tiny_config
from pipelinerl_jax.models.params import path_name

# H*X (32) != D (48), K*X (16) != H*X: a transposed or mis-flattened matrix cannot fit.
FAMILIES = {
    "qwen2": dict(tie_word_embeddings=True),
    "llama": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=False),
}


def lora_model(family, spec, seed=0):
    cfg = tiny_config(family, vocab_size=61, hidden_size=48, intermediate_size=80,
                      num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32",
                      param_dtype="float32", **FAMILIES[family])
    model = Decoder(cfg, nnx.Rngs(seed))
    add_lora(model, spec, nnx.Rngs(seed + 1))
    rng = np.random.default_rng(seed + 2)  # a trained adapter: B (and biases) off zero
    for path, var in jax.tree_util.tree_flatten_with_path(
            nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        name = path_name(path)
        if name.endswith("_lora_b") or "bias" in name:
            var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.shape), var.dtype))
    return cfg, model
