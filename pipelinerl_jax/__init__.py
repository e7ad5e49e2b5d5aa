"""pipelinerl_jax: asynchronous pipeline RL on language models, JAX-first."""

__version__ = "0.1.0"
