"""Shared pieces of the engine tests: one engine shape (so every test reuses the same compiled
programs), tiny models with peaked next-token distributions, and the learner-side reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.models import Decoder, init_cache, tiny_config
from pipelinerl_jax.rollout.jax_engine import JaxEngine
from pipelinerl_jax.records import GenerationRequest, SamplingParams

# Every test engine has this shape: 2 prefill lengths x 2 prefill batches + 2 decode buckets.
SHAPE = dict(max_slots=4, max_seq_len=64, prefill_buckets=(16, 64), cache_buckets=(32, 64),
             max_prefill_batch=2, steps_per_sync=4)
REF_LEN = 64  # the reference forward pads every sequence to this (one compile)


def make_model(seed: int):
    """A tiny decoder with weight matrices scaled up so that next-token distributions are
    peaked (entropy ~2.9 nats of 4.2) and depend strongly on the context: stop tokens fire,
    temperatures matter, and KV-cache mistakes or two versions' weights show in log-probs."""
    model = Decoder(tiny_config(), nnx.Rngs(seed))
    nnx.update(model, jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, nnx.state(model)))
    return model


@pytest.fixture(scope="session")
def models():
    return {v: make_model(100 + v) for v in range(5)}  # weights of versions 0..4


def run_until(eng, n):
    """Steps `eng` until `n` completions have come out; returns them."""
    out = []
    while len(out) < n:
        eng.step()
        out += eng.get_completions()
    return out


def make_engine(model, start=False, mesh=None, **overrides):
    """An engine of the test shape; `mesh`: a `(data, fsdp, tensor)` shape over the first of
    the 8 test devices (None: one device)."""
    if mesh is not None:
        mesh = sharding.make_mesh(mesh)
    return JaxEngine(model, {**SHAPE, **overrides}, start=start, mesh=mesh)


@pytest.fixture(scope="session")
def full_logits():
    """`full_logits(model, seq) -> float32 [len(seq), V]`: one plain full forward, the way
    the learner scores a sequence (right-padded to REF_LEN so it compiles once)."""
    fwd = nnx.jit(lambda m, ids: m(ids))

    def logits(model, seq):
        ids = np.zeros((1, REF_LEN), np.int32)
        ids[0, :len(seq)] = seq
        return np.asarray(fwd(model, jnp.asarray(ids))[0, :len(seq)])
    return logits


@pytest.fixture(scope="session")
def reference(full_logits):
    """`ref(model, prompt, tokens, temperature) -> logp [C]`: the learner's recomputation,
    log softmax(logits / T) of each completion token under one full forward."""
    def ref(model, prompt, tokens, temperature=1.0):
        seq = np.concatenate([prompt, tokens]).astype(np.int32)
        z = full_logits(model, seq)[len(prompt) - 1:len(seq) - 1] / temperature
        logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - z.max(-1, keepdims=True)
        return logp[np.arange(len(tokens)), tokens]
    return ref


@pytest.fixture(scope="session")
def replay_keep():
    """Reference for kv_policy='keep': prefill the prompt with the start version's weights,
    then feed each token with the weights of the version that sampled the next one, keeping
    every K/V entry as written (the cached forward path, one token at a time)."""
    fwd = nnx.jit(lambda m, ids, pos, cache: m(ids, positions=pos, cache=cache))

    def replay(models, prompt, tokens, versions, start_version, temperature=1.0):
        cfg = models[start_version].cfg
        cache = init_cache(cfg, 1, REF_LEN)
        ids = np.zeros((1, 16), np.int32)
        ids[0, :len(prompt)] = prompt
        logits, cache = fwd(models[start_version], jnp.asarray(ids),
                            jnp.arange(16, dtype=jnp.int32)[None], cache)
        out = [logits[0, len(prompt) - 1]]
        for t in range(1, len(tokens)):
            pos = jnp.full((1, 1), len(prompt) + t - 1, jnp.int32)
            logits, cache = fwd(models[int(versions[t])], jnp.asarray([[tokens[t - 1]]]),
                                pos, cache)
            out.append(logits[0, 0])
        logp = jax.nn.log_softmax(jnp.stack(out) / temperature, axis=-1)
        return np.asarray(logp[jnp.arange(len(tokens)), jnp.asarray(tokens)])
    return replay


def request(rid, prompt, **params):
    prompt = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt, np.int32)
    return GenerationRequest(rid, prompt, SamplingParams(**params))


def random_requests(n, seed=0, max_prompt=12, lognormal=(2.5, 0.8), max_new_cap=48, **params):
    """Requests with long-tailed lengths: max_new_tokens ~ lognormal, capped."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, 64, int(rng.integers(1, max_prompt + 1)))
        max_new = int(min(max(rng.lognormal(*lognormal), 1), max_new_cap))
        out.append(request(f"r{seed}-{i}", prompt, max_new_tokens=max_new, seed=1000 + i,
                           **params))
    return out
