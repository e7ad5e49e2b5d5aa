"""Adapter-only publication to the JaxEngine (docs/lora.md): a version carries only the LoRA
adapters over the real gRPC weight stream; the engine applies them unmerged on its one copy
of the base (a version swaps only the adapter arrays) and samples what an engine given the
fully merged weights samples (log-probs within 5e-5: float32 rounding of two summation
orders, up to 1.1e-5 on an Intel Xeon with AVX-512); per-token provenance and in-flight
updates are unchanged; adapters that do not fit its base are refused and nothing is
installed."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.models import (LoRASpec, WeightsMismatch, adapter_params, add_lora,
                                   decoder_from_flat, flat_params, merged_params)
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.transport.retry import RetryPolicy
from pipelinerl_jax.transport.weight_version import WeightVersion, WeightVersionRefused
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber
from tests.rollout.conftest import SHAPE, make_model, random_requests
from tests.rollout.conftest import run_until
from tests.rollout.test_weight_updates import check_recompute

SPEC = LoRASpec(rank=4, alpha=8.0)
BASE = "c" * 64  # the base's sha256 as the run describes it
SERVES = WeightVersion("lora", BASE, SPEC)


def _msg(version, adapters, spec=SPEC):
    return WeightVersion("lora", BASE, spec).carrying(version, tensors=adapters)
FAST = RetryPolicy(initial_s=0.01, max_s=0.1)


def _trained_adapter(base, seed, spec=SPEC):
    """`base` (copied) with adapters whose B is non-zero, big enough to change samples."""
    model = add_lora(nnx.clone(base), spec, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in jax.tree_util.tree_flatten_with_path(
            nnx.state(model, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        if str(path[-1].key).endswith("_lora_b"):
            var.set_value(jnp.asarray(0.5 * rng.standard_normal(var.shape), var.dtype))
    return model


@pytest.fixture(scope="module")
def lora_versions():
    """{version: a LoRA model}, version 0 = fresh adapters (the base itself)."""
    base = make_model(100)
    out = {0: add_lora(nnx.clone(base), SPEC, nnx.Rngs(0))}
    out.update({v: _trained_adapter(base, seed=v) for v in (1, 2)})
    return base, out


def _greedy(engine, n=6):
    reqs = random_requests(n, seed=11, max_new_cap=24, temperature=0.0)
    return {c.request_id: c for c in engine.generate(reqs)}


def test_adapter_only_publication_over_grpc_equals_the_merged_weights(lora_versions):
    base, versions = lora_versions
    adapters = adapter_params(versions[1])
    merged = merged_params(versions[1], SPEC)
    full_bytes = sum(a.nbytes for a in flat_params(base).values())
    adapter_bytes = sum(a.nbytes for a in adapters.values())
    print(f"\nbytes per published version: adapters {adapter_bytes} vs full {full_bytes} "
          f"(ratio {adapter_bytes / full_bytes:.4f}, rank {SPEC.rank}, all projections)")
    assert adapter_bytes < full_bytes / 4

    lora_engine = JaxEngine(base, SHAPE, serves=SERVES)
    merged_engine = JaxEngine(base, SHAPE)
    before = _greedy(lora_engine)
    assert set(lora_engine.weight_shapes()) == set(adapters)
    with WeightPublisher() as pub:
        sub = WeightSubscriber(pub.address, lambda m: lora_engine.update_weights(m, m.version),
                               retry=FAST, expected_shapes=lora_engine.weight_shapes(),
                               accepts=lora_engine.serves)
        base_arrays = {k: v for k, v in flat_params(lora_engine.params, host=False).items()
                       if "_lora_" not in k}
        try:
            pub.publish(_msg(1, adapters))
            assert sub.wait_for_version(1, 30)
        finally:
            sub.close()
    assert lora_engine.version == 1
    merged_engine.update_weights(merged, 1)
    got, want = _greedy(lora_engine), _greedy(merged_engine)
    for rid, c in want.items():
        np.testing.assert_array_equal(got[rid].token_ids, c.token_ids, err_msg=rid)
        # the two summation orders round apart (1.1e-5 seen on an Intel Xeon, AVX-512)
        np.testing.assert_allclose(got[rid].logp_behaviour, c.logp_behaviour, atol=5e-5)
        assert (got[rid].version == 1).all()
    assert any(not np.array_equal(before[r].token_ids, got[r].token_ids) for r in got), \
        "the adapters changed no greedy sample: the comparison would prove nothing"
    # unmerged: the version swapped only the adapters; the base arrays are the same objects
    live = flat_params(lora_engine.params, host=False)
    for name, w in base_arrays.items():
        assert live[name] is w, name
    for name, a in adapters.items():
        np.testing.assert_array_equal(np.asarray(live[name]), a, err_msg=name)
    # staged: the next adapters, and the packed buffer they travel in on each device (one)
    assert lora_engine.memory["staged_weight_bytes"] == 2 * adapter_bytes
    lora_engine.close()
    merged_engine.close()


def test_in_flight_adapter_updates_keep_per_token_provenance(lora_versions, reference):
    """kv_policy='recompute': every token's log-prob is the learner's forward (adapters
    applied unmerged) under the version that sampled it; lag injection may go back."""
    base, versions = lora_versions
    eng = JaxEngine(base, {**SHAPE, "kv_policy": "recompute"}, serves=SERVES)
    reqs = random_requests(6, seed=5, lognormal=(3.3, 0.3), max_new_cap=45)
    eng.submit_batch(reqs)
    done = []
    for v in (1, 2):
        for _ in range(2):
            eng.step()
            done += eng.get_completions()
        eng.update_weights(_msg(v, adapter_params(versions[v])), v)
        assert eng.version == v
    done += run_until(eng, len(reqs) - len(done))
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in reqs)
    assert any(len(set(c.version.tolist())) == 3 for c in done)
    for c in done:
        check_recompute(c, versions, reference)
    eng.update_weights(_msg(1, adapter_params(versions[1])), 1, allow_older=True)  # lag inj.
    assert eng.version == 1
    live = flat_params(eng.params)
    for name, w in adapter_params(versions[1]).items():  # version 1's adapters, on the base
        np.testing.assert_array_equal(live[name], w)
    eng.close()


def test_adapters_that_do_not_fit_the_engines_base_are_refused(lora_versions):
    base, versions = lora_versions
    eng = JaxEngine(base, SHAPE, serves=SERVES)
    good = adapter_params(versions[1])
    qa = "layers/0/attn/q_proj_lora_a"
    other_rank = adapter_params(_trained_adapter(base, 3, LoRASpec(rank=2, alpha=8.0)))
    few = adapter_params(_trained_adapter(base, 3, LoRASpec(4, 8.0, ("q_proj", "v_proj"))))
    cases = {
        "rank": (other_rank, r"has shape \(\d+, 2\), this engine needs \(\d+, 4\) \(rank 4\)"),
        "targets": (few, r"missing \['layers/0/attn/k_proj_lora_a'"),
        "no base": ({**good, "layers/7/attn/q_proj_lora_a": good[qa]},
                    r"unknown \['layers/7/attn/q_proj_lora_a'\]"),
        "one shape": ({**good, qa: good[qa][:-1]}, r"'layers/0/attn/q_proj_lora_a' has shape"),
    }
    for what, (bad, message) in cases.items():
        with pytest.raises(WeightsMismatch, match=message):
            eng.update_weights(_msg(1, bad), 1)
        assert eng.version == 0, what
    full = flat_params(decoder_from_flat(merged_params(versions[2], SPEC), base.cfg))
    for bad, why in [(WeightVersion("full").carrying(1, tensors=full), "kind 'full'"),
                     (good, "hand it a WeightVersion"),
                     (WeightVersion("lora", "d" * 64, SPEC).carrying(1, tensors=good),
                      f"base sha256 {'d' * 64}, this receiver holds base sha256 {BASE}"),
                     (_msg(1, other_rank, LoRASpec(rank=2, alpha=8.0)), "does not match")]:
        with pytest.raises(WeightVersionRefused, match=why):
            eng.update_weights(bad, 1)
        assert eng.version == 0
    eng.update_weights(_msg(2, good), 2)
    assert eng.version == 2
    eng.close()
