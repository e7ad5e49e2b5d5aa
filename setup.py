"""pipelinerl_jax: asynchronous pipeline RL for language models, JAX-first."""
from setuptools import find_packages, setup

setup(
    name="pipelinerl_jax",
    version="0.1.0",
    description="Asynchronous pipeline reinforcement learning on language models, JAX/TPU-first.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["pipelinerl_jax", "pipelinerl_jax.*"],
                           exclude=["pipelinerl_jax.testing", "pipelinerl_jax.testing.*"]),
    package_data={"pipelinerl_jax.transport": ["*.proto"]},
    install_requires=[
        "jax>=0.7.0,<0.11",
        "flax>=0.12.0,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11.0,<0.13",
        "ml-collections>=1.0.0,<2",
        "absl-py>=2.0,<3",
        # The checked-in gencode (pipelinerl_jax/transport/rollout_pb2*.py, protoc 35.1 via
        # grpcio-tools 1.85.1) requires protobuf >= 7.35.1 and grpcio >= 1.85.1 at run time.
        "grpcio>=1.85.1,<2",
        "grpcio-health-checking>=1.85.1,<2",
        "protobuf>=7.35.1,<8",
        "ml-dtypes>=0.5,<1",  # bfloat16 weights on the wire (also a jax dependency)
        "transformers>=4.50,<6",  # configs and tokenizers only; models are ours
        "numpy>=1.26,<3",
        "scipy>=1.11,<2",  # Student's t quantiles (ablation/stats.py); jax needs it too
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
    ],
    extras_require={
        # torch is only the reference implementation in parity tests.
        "dev": [
            "pytest>=8,<10",
            "pytest-xdist>=3.5,<4",  # the fast tier on every core (-n auto)
            "hypothesis>=6.100,<7",
            "grpcio-tools>=1.85.1,<2",  # regenerates the proto modules (gen_proto)
            "cryptography>=42,<50",  # self-signed TLS pairs in tests
            "torch==2.13.0",
            # TensorBoard's compiled protobuf classes decode our event files in a test (an
            # oracle for pipelinerl_jax/tb_events.py) and scripts/bench_metrics.py's baseline
            "tensorboardX>=2.6,<3",
            "peft>=0.21.2,<0.22",  # loads our exported LoRA adapters in the parity test
            "safetensors>=0.4,<1",  # an independent reader of our files in tests (hf_io reads its own)
        ],
        # The TPU runtime and compiler (libtpu from PyPI): runs on a TPU VM, and on any CPU
        # host compiles a run's programs for a TPU topology (experiments/compile_check.py).
        "tpu": ["jax[tpu]==0.10.2"],
        # GPU hosts that launch SGLang servers; never needed on CPU.
        "sglang": ["sglang[all]>=0.5"],
    },
)
