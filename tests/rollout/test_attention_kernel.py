"""`engine.attention_kernel`: the paged engine's decode attention through a Pallas kernel
(`models/paged_kernels.py`). On CPU 'pallas' runs JAX's Triton paged attention kernel in
Pallas interpret mode: the engine's samples equal the reference's token for token, log-probs
within 1e-5. 'auto' is the reference on CPU; a bad value is a ConfigError naming the key."""
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.rollout.jax_engine import engine_config, validate_engine_config
from tests.rollout.conftest import make_engine, random_requests, run_until

PAGED = dict(kv_layout="paged", page_size=8)


def _samples(eng, reqs):
    for r in reqs:
        eng.submit(r)
    return {c.request_id: c for c in run_until(eng, len(reqs))}


def test_pallas_kernel_engine_equals_reference_engine(models):
    reqs = (random_requests(3, seed=31, lognormal=(3.0, 0.4), max_new_cap=30, temperature=0.0)
            + random_requests(3, seed=32, lognormal=(3.0, 0.4), max_new_cap=30, top_p=0.9))
    ref_eng = make_engine(models[0], attention_kernel="reference", **PAGED)
    assert ref_eng.attention_impl == "reference"
    kern_eng = make_engine(models[0], attention_kernel="pallas", **PAGED)
    assert kern_eng.attention_impl == "gpu_paged_interpret"
    ref, kern = _samples(ref_eng, reqs), _samples(kern_eng, reqs)
    assert ref.keys() == kern.keys()
    for rid, r in ref.items():
        np.testing.assert_array_equal(kern[rid].token_ids, r.token_ids, err_msg=rid)
        np.testing.assert_allclose(kern[rid].logp_behaviour, r.logp_behaviour, atol=1e-5,
                                   err_msg=rid)


def test_auto_is_the_reference_on_cpu(models):
    assert make_engine(models[0], **PAGED).attention_impl == "reference"
    assert make_engine(models[0], attention_kernel="pallas").attention_impl == "reference"  # dense


def test_bad_kernel_name_names_the_key():
    cfg = engine_config()
    cfg.attention_kernel = "triton"
    with pytest.raises(ConfigError, match="engine.attention_kernel"):
        validate_engine_config(cfg)
