"""The sampling distribution and its log-probs (pipelinerl_jax.rollout.sampling docstring)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.rollout.sampling import RowParams, sample, truncate

V = 8
LOGITS = np.array([2.0, 1.5, 1.5, 0.5, 0.0, -1.0, -2.0, -3.0], np.float32)


def rows(b, temperature=1.0, top_p=1.0, top_k=0, seed=7):
    return RowParams(seed=jnp.full((b,), seed, jnp.uint32),
                     sample_index=jnp.arange(b, dtype=jnp.int32),
                     temperature=jnp.full((b,), temperature, jnp.float32),
                     top_p=jnp.full((b,), top_p, jnp.float32),
                     top_k=jnp.full((b,), top_k, jnp.int32),
                     stop_ids=jnp.full((b, 1), -1, jnp.int32), limit=jnp.zeros((b,), jnp.int32))


_sample = jax.jit(sample, static_argnames="logprob_mode")


def expected_q(temperature, top_p, top_k):
    """The documented distribution, computed independently in NumPy."""
    z = LOGITS / temperature
    order = np.argsort(-z, kind="stable")
    k = top_k or V
    keep = np.zeros(V, bool)
    pk = np.exp(z[order[:k]] - z[order[:k]].max())
    pk /= pk.sum()
    mass_before = np.cumsum(pk) - pk
    n_keep = max(int((mass_before < top_p).sum()), 1)
    threshold = z[order[n_keep - 1]]
    keep = z >= threshold
    q = np.where(keep, np.exp(z - z.max()), 0.0)
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_p,top_k", [
    (1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 1.0, 2), (1.0, 0.6, 0), (0.8, 0.9, 4)])
def test_empirical_distribution_and_logprobs(temperature, top_p, top_k):
    n = 20000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, V))
    r = rows(n, temperature, top_p, top_k)
    pos = jnp.full((n,), 3, jnp.int32)
    tok, logp = map(np.asarray, _sample(logits, r, pos, logprob_mode="sampled"))
    q = expected_q(temperature, top_p, top_k)
    freq = np.bincount(tok, minlength=V) / n
    assert np.all(freq[q == 0] == 0), "a token outside the top-k/top-p support was sampled"
    # within 4.5 standard errors per token
    assert np.all(np.abs(freq - q) <= 4.5 * np.sqrt(q * (1 - q) / n) + 1e-9), (freq, q)
    np.testing.assert_allclose(logp, np.log(q[tok]), atol=1e-5)
    # 'tempered' reports the untruncated log softmax(logits / T) of the same tokens.
    tok2, logp2 = map(np.asarray, _sample(logits, r, pos, logprob_mode="tempered"))
    np.testing.assert_array_equal(tok2, tok)
    z = LOGITS / temperature
    np.testing.assert_allclose(logp2, (z - np.log(np.exp(z).sum()))[tok], atol=1e-5)


def test_ties_at_the_cut_are_kept():
    # tokens 1 and 2 tie; top_k=2 keeps {0, 1, 2}
    out = np.asarray(truncate(jnp.asarray(LOGITS)[None], jnp.asarray([2]), jnp.asarray([1.0])))
    assert np.isfinite(out[0]).tolist() == [True, True, True] + [False] * 5


def test_greedy_takes_argmax_and_reports_untempered_logp():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]))
    tok, logp = _sample(logits, rows(2, temperature=0.0, top_k=1), jnp.zeros(2, jnp.int32))
    assert np.asarray(tok).tolist() == [0, V - 1]
    full = np.asarray(jax.nn.log_softmax(logits))
    np.testing.assert_allclose(np.asarray(logp), full[[0, 1], [0, V - 1]], atol=1e-6)


def test_draw_depends_only_on_seed_sample_and_position():
    """The same (seed, sample_index, position) gives the same token in any row, whatever the
    other rows hold; another position or seed gives another draw."""
    b = 8
    flat = jnp.zeros((b, V))  # uniform: the draw is the uniform variate itself

    def draw(row, seed, index, pos, others_seed=0):
        r = rows(b, seed=others_seed)
        r = r._replace(seed=r.seed.at[row].set(seed),
                       sample_index=r.sample_index.at[row].set(index))
        return int(_sample(flat, r, jnp.full((b,), pos).at[(row + 1) % b].set(99))[0][row])
    a = draw(0, 5, 2, 10)
    assert all(draw(row, 5, 2, 10, others_seed=s) == a for row, s in [(3, 1), (7, 9)])
    others = {draw(0, 5, 2, p) for p in range(11, 30)} | {draw(0, s, 2, 10) for s in range(6, 25)}
    assert len(others) > 3
