"""Ahead-of-time compilation of a run's programs for a TPU topology on a CPU host: the chip
table (`chips`), the programs a run executes with their abstract inputs (`programs`), and the
compile-and-report step (`check`) behind `experiments/compile_check.py` (docs/tpu.md)."""
