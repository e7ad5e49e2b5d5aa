"""Decoder models (Llama-3 / Qwen2 / Qwen3) and Hugging Face checkpoint I/O."""
from pipelinerl_jax.models.decoder_config import (CheckpointError, ModelConfig, config_100m,
                                          config_qwen2_5_0_5b, tiny_config)
from pipelinerl_jax.models.model import (Decoder, KVCache, init_cache, token_entropy,
                                         token_logprobs)

from pipelinerl_jax.models.paged_attention import (PagedKVCache, init_paged_cache,  # noqa: E402
                                                   paged_attention)

__all__ = ["PagedKVCache", "init_paged_cache", "paged_attention", "CheckpointError", "ModelConfig", "Decoder", "KVCache", "init_cache",
           "token_logprobs", "token_entropy", "tiny_config", "config_100m",
           "config_qwen2_5_0_5b"]
from pipelinerl_jax.models.hf_io import (from_pretrained, hf_state_dict, load_config,  # noqa: E402
                                         save_pretrained, write_hf_dir)

__all__ += ["from_pretrained", "save_pretrained", "hf_state_dict", "load_config", "write_hf_dir"]
from pipelinerl_jax.models.params import (LeafSlots, WeightsMismatch,  # noqa: E402
                                          decoder_from_flat, flat_params, param_shapes,
                                          state_from_flat)

__all__ += ["flat_params", "state_from_flat", "param_shapes", "decoder_from_flat",
            "WeightsMismatch", "LeafSlots"]
from pipelinerl_jax.models.lora import (LoRASpec, adapter_params, add_lora,  # noqa: E402
                                        base_params, merge_lora, merged_params)

__all__ += ["LoRASpec", "add_lora", "adapter_params", "base_params", "merge_lora",
            "merged_params"]
