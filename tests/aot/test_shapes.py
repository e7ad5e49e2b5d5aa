"""The shape-only configs: their parameter counts are the model cards' totals."""
import os

import pytest

from pipelinerl_jax.models.hf_io import load_config

SHAPES = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "shapes")


@pytest.mark.parametrize("name,billions", [
    ("qwen2.5-0.5b", 0.49), ("qwen2.5-1.5b", 1.54), ("qwen2.5-7b", 7.61), ("qwen3-8b", 8.19)])
def test_parameter_count_matches_the_model_card(name, billions):
    cfg = load_config(os.path.join(SHAPES, name))
    assert cfg.num_params / 1e9 == pytest.approx(billions, abs=0.006)
