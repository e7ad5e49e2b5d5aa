"""In-flight weight updates: ordering, atomicity, no dropped requests, per-token provenance
under kv_policy='recompute' (AReaL) and 'keep' (PipelineRL)."""
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.models import flat_params, save_pretrained
from tests.rollout.conftest import make_engine, make_model, random_requests, request, run_until


def check_recompute(c, models, reference, temperature=1.0):
    """Each token's log-prob is the learner's full-forward log-prob under the weights of the
    version that sampled it; under recompute the KV it attended to is that version's too."""
    np.testing.assert_array_equal(c.kv_version, c.version)
    assert (np.diff(c.version) >= 0).all() and c.version[0] >= c.start_version
    for v in np.unique(c.version):
        ref = reference(models[int(v)], c.prompt_ids, c.token_ids, temperature)
        at = c.version == v
        np.testing.assert_allclose(c.logp_behaviour[at], ref[at], atol=1e-4,
                                   err_msg=f"{c.request_id}: tokens of version {v}")


# Provenance must hold on both KV layouts (the paged one with a pool as large as the dense
# cache: no preemption here; tests/rollout/test_paged_engine.py covers preemption), on one
# device and on an engine mesh (tensor axis 4 > the model's 2 kv heads: weights and pool
# split over 4 devices, each kv head stored twice; data and fsdp 2 on the dense one).
LAYOUTS = pytest.mark.parametrize("layout", [
    {}, {"kv_layout": "paged", "page_size": 8},
    {"mesh": (2, 2, 2)}, {"kv_layout": "paged", "page_size": 8, "mesh": (1, 1, 4)}],
    ids=["dense", "paged", "dense-mesh8", "paged-mesh4"])


@LAYOUTS
def test_recompute_logprobs_follow_each_tokens_version(models, reference, layout):
    eng = make_engine(models[0], kv_policy="recompute", **layout)
    reqs = random_requests(6, seed=5, lognormal=(3.3, 0.3), max_new_cap=45)
    for r in reqs:
        eng.submit(r)
    done = []
    for _ in range(2):
        eng.step()
        done += eng.get_completions()
    eng.update_weights(flat_params(models[1]), 1)  # flat {path: np.ndarray} payload
    assert eng.version == 1
    for _ in range(2):
        eng.step()
        done += eng.get_completions()
    eng.update_weights(nnx.state(models[2], nnx.Param), 2)  # an nnx.State
    done += run_until(eng, len(reqs) - len(done))
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in reqs)
    assert all(c.finish_reason == "length" for c in done)
    crossed = [c for c in done if len(set(c.version.tolist())) == 3]
    assert crossed, "no sequence spanned both updates"
    assert {c.start_version for c in done} >= {0, 1} or {c.start_version for c in done} >= {0, 2}
    for c in done:
        check_recompute(c, models, reference)


@LAYOUTS
def test_keep_policy_provenance_and_logprobs(models, replay_keep, reference, layout):
    eng = make_engine(models[0], kv_policy="keep", **layout)
    reqs = random_requests(4, seed=6, lognormal=(3.3, 0.2), max_new_cap=40, temperature=0.8)
    for r in reqs:
        eng.submit(r)
    eng.step()
    eng.step()
    eng.update_weights(models[3], 3)  # a model object; versions may skip
    done = run_until(eng, len(reqs))
    for c in done:
        # Sampled by version 0, then by version 3 over the KV version 0 wrote: kv_version
        # stays the admission version for every token.
        assert c.start_version == 0 and (c.kv_version == 0).all()
        switch = int(np.argmax(c.version == 3))
        assert switch > 0 and (c.version[:switch] == 0).all() and (c.version[switch:] == 3).all()
        ref = replay_keep(models, c.prompt_ids, c.token_ids, c.version, 0, 0.8)
        np.testing.assert_allclose(c.logp_behaviour, ref, atol=1e-4)
        # ...which is not what a full forward with version 3 computes (the KV is older).
        full = reference(models[3], c.prompt_ids, c.token_ids, 0.8)
        assert np.abs(full[switch + 1:] - c.logp_behaviour[switch + 1:]).max() > 1e-2
    # A sample admitted after the update runs entirely on version 3.
    late = eng.generate([request("late", [5, 6], max_new_tokens=5, seed=1)])[0]
    assert late.start_version == 3 and (late.version == 3).all() and (late.kv_version == 3).all()


def test_stale_and_duplicate_versions_are_rejected(models):
    eng = make_engine(models[0], kv_policy="keep")
    eng.update_weights(flat_params(models[1]), 2)
    for stale in (2, 1, -5):
        with pytest.raises(ValueError, match=rf"version {stale} is not newer than the "
                                             r"engine's version 2"):
            eng.update_weights(flat_params(models[2]), stale)
    with pytest.raises(ValueError, match="version must be an integer"):
        eng.update_weights(flat_params(models[2]), 3.0)
    assert eng.version == 2
    # Weights that do not fit the model are refused and change nothing.
    bad = flat_params(models[2])
    bad.pop("embed")
    with pytest.raises(ValueError, match="missing \\['embed'\\]"):
        eng.update_weights(bad, 3)
    bad = flat_params(models[2])
    bad["embed"] = bad["embed"][:, :3]
    with pytest.raises(ValueError, match="'embed' has shape"):
        eng.update_weights(bad, 3)
    c = eng.generate([request("x", [1, 2], max_new_tokens=3, seed=0)])[0]
    assert eng.version == 2 and (c.version == 2).all()
    # What a weight subscriber is told to expect is exactly what the engine takes.
    assert eng.weight_shapes() == {k: tuple(v.shape) for k, v in flat_params(models[2]).items()}


def test_update_from_checkpoint_dir_and_no_aliasing_of_learner_buffers(models, reference,
                                                                        tmp_path):
    eng = make_engine(models[0])
    save_pretrained(models[4], str(tmp_path))
    eng.update_weights(str(tmp_path), 1)
    c = eng.generate([request("ckpt", [3, 1, 4], max_new_tokens=8, seed=2)])[0]
    np.testing.assert_allclose(c.logp_behaviour,
                               reference(models[4], c.prompt_ids, c.token_ids), atol=1e-4)
    # The engine copies what it is given: a learner that later overwrites (or donates) its
    # buffers does not change the engine's weights.
    learner = make_model(102)  # same weights as models[2]
    eng.update_weights(nnx.state(learner, nnx.Param), 2)
    nnx.update(learner, jax.tree.map(lambda x: x * 0, nnx.state(learner)))
    c = eng.generate([request("alias", [3, 1, 4], max_new_tokens=8, seed=2)])[0]
    np.testing.assert_allclose(c.logp_behaviour,
                               reference(models[2], c.prompt_ids, c.token_ids), atol=1e-4)


def test_threaded_updates_are_atomic_ordered_and_drop_nothing(models, reference):
    """A background loop samples while another thread pushes versions 1..4. Every token's
    log-prob must match one whole version's weights (a step mixing two versions' tensors
    would match neither), versions never go backwards, and every request finishes."""
    eng = make_engine(models[0], kv_policy="recompute", start=True)
    reqs = random_requests(16, seed=7, lognormal=(3.0, 0.5), max_new_cap=45)
    payloads = {v: flat_params(models[v]) for v in range(1, 5)}
    errors = []

    def updater():
        try:
            while eng.stats()["generated_tokens"] < 20:  # updates land mid-generation
                time.sleep(0.001)
            for v in range(1, 5):
                time.sleep(0.01)
                eng.update_weights(payloads[v], v)
                assert eng.version >= v
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=updater)
    for r in reqs:
        eng.submit(r)
    t.start()
    done = []
    deadline = time.monotonic() + 120
    while len(done) < len(reqs) and time.monotonic() < deadline:
        done += eng.get_completions(timeout=1.0)
    t.join()
    assert not errors, errors
    assert eng.health()["ok"] and eng.version == 4
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in reqs)
    assert all(c.finish_reason == "length" for c in done)
    assert any(len(set(c.version.tolist())) > 1 for c in done)
    for c in done:
        check_recompute(c, models, reference)
    assert eng.stats()["updates_applied"] == 4
    eng.close()


def test_pause_stops_sampling_and_takes_updates(models):
    eng = make_engine(models[0], start=True)
    eng.submit(request("long", [1, 2, 3], max_new_tokens=60, seed=3))
    while eng.stats()["generated_tokens"] == 0:
        time.sleep(0.001)
    eng.pause()
    before = eng.stats()["generated_tokens"]
    time.sleep(0.1)
    assert eng.stats()["generated_tokens"] == before and eng.health()["paused"]
    eng.update_weights(flat_params(models[1]), 1, timeout=30)  # applied while paused
    assert eng.version == 1
    eng.resume()
    (c,) = eng.get_completions(timeout=60)
    assert c.finish_reason == "length" and len(c.token_ids) == 60
    assert c.version[0] == 0 and c.version[-1] == 1
    assert (c.version[before:] == 1).all() and (c.version[:before] == 0).all()
    eng.close()
    assert eng.health()["ok"] is False and eng.health()["error"] is None
