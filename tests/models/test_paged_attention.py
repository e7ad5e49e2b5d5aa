"""The paged KV cache against two independent oracles: the dense cached forward and the
uncached full forward. Pages are assigned at random (shuffled, non-contiguous, interleaved
between rows), rows have different prompt lengths, and decode runs several steps; a GQA
config (4 query heads over 2 kv heads) and a qwen2/qwen3 variant (biases, q/k norms) are
covered."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelinerl_jax.models import (Decoder, PagedKVCache, init_cache, init_paged_cache,
                                   paged_attention, tiny_config)
from pipelinerl_jax.models.paged_attention import gather_pages, kv_pool, split_kv, write_pages


def _model(model_type, seed=0):
    model = Decoder(tiny_config(model_type), nnx.Rngs(seed))
    # Scaled-up weights: peaked, context-dependent logits, so a misplaced key shows.
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, nnx.state(model)))
    return model


def _random_tables(rng, batch, pages_per_row, num_pages):
    """Each row gets `pages_per_row` distinct pages drawn from a shuffled pool (rows never
    share a page); returns `[B, N]` int32."""
    perm = rng.permutation(num_pages)[:batch * pages_per_row]
    return perm.reshape(batch, pages_per_row).astype(np.int32)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_cached_forward_matches_dense_and_uncached(model_type, page_size):
    model = _model(model_type)
    cfg = model.cfg
    assert cfg.num_heads // cfg.num_kv_heads == 2  # GQA
    rng = np.random.default_rng(page_size)
    b, max_len, decode_steps = 3, 48, 6
    lengths = np.array([5, 17, 11])  # ragged prompts, one spanning several pages
    total = int(lengths.max()) + decode_steps
    seqs = rng.integers(1, cfg.vocab_size, size=(b, total)).astype(np.int32)
    n_cols = -(-max_len // page_size)
    num_pages = b * n_cols + 5  # spare pages: some pool pages belong to nobody
    tables = jnp.asarray(_random_tables(rng, b, n_cols, num_pages))

    fwd = nnx.jit(lambda m, ids, pos, cache: m(ids, positions=pos, cache=cache))
    full_fwd = nnx.jit(lambda m, ids: m(ids))  # uncached, right-padded to `total` (causal)
    # prefill: right-padded prompts [B, T]; padding writes junk beyond each row's length
    t = int(lengths.max())
    ids = np.where(np.arange(t)[None] < lengths[:, None], seqs[:, :t], 0).astype(np.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    dense_logits, dense = fwd(model, ids, pos, init_cache(cfg, b, max_len))
    paged_logits, paged = fwd(model, ids, pos, init_paged_cache(cfg, num_pages, page_size,
                                                                tables))
    assert isinstance(paged, PagedKVCache)
    for j in range(b):  # only real prompt positions are meaningful
        np.testing.assert_allclose(paged_logits[j, :lengths[j]], dense_logits[j, :lengths[j]],
                                   atol=1e-5, rtol=1e-5)
    # decode: each row feeds its next token at its own position
    cur = lengths.copy()
    for _ in range(decode_steps):
        tok = seqs[np.arange(b), cur][:, None]
        p = jnp.asarray(cur[:, None].astype(np.int32))
        d_logits, dense = fwd(model, tok, p, dense)
        p_logits, paged = fwd(model, tok, p, paged)
        np.testing.assert_allclose(p_logits, d_logits, atol=1e-5, rtol=1e-5)
        # ... and both equal the uncached forward over the whole sequence so far
        full = full_fwd(model, jnp.asarray(seqs))
        np.testing.assert_allclose(p_logits[:, 0], full[np.arange(b), cur], atol=1e-4,
                                   rtol=1e-4)
        cur += 1
    assert np.abs(np.asarray(p_logits)).max() > 1.0  # logits are not trivially equal


def test_pages_beyond_a_row_and_other_rows_pages_are_never_read():
    """A row's attention depends only on its own pages up to its position: scribbling over
    every other page (other rows', unassigned ones, its own beyond its position) changes
    nothing; scribbling on one of its visible positions does."""
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    num_pages, c = 12, 4
    tables = jnp.asarray(np.array([[7, 2, 9], [0, 11, 4]], np.int32))
    pool_k = jnp.asarray(rng.normal(size=(num_pages, c, cfg.num_kv_heads, cfg.head_dim)),
                         jnp.float32)
    pool_v = jnp.asarray(rng.normal(size=pool_k.shape), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 1, cfg.num_heads, cfg.head_dim)), jnp.float32)
    positions = jnp.asarray([[5], [9]], jnp.int32)  # row 0 sees pages 7, 2[:2]
    out = paged_attention(q, kv_pool(pool_k, pool_v), tables, positions)
    mask = np.ones((num_pages, c), bool)  # True = may be scribbled on for row 0
    mask[7, :] = False
    mask[2, :2] = False
    junk_k = jnp.where(mask[..., None, None], 100.0, pool_k)
    junk_v = jnp.where(mask[..., None, None], -100.0, pool_v)
    out2 = paged_attention(q, kv_pool(junk_k, junk_v), tables, positions)
    np.testing.assert_allclose(out2[0], out[0], atol=1e-6)
    assert np.abs(np.asarray(out2[1] - out[1])).max() > 1e-2  # row 1's pages did change
    out3 = paged_attention(q, kv_pool(pool_k.at[2, 1].add(1.0), pool_v), tables, positions)
    assert np.abs(np.asarray(out3[0] - out[0])).max() > 1e-4


def test_writes_to_unheld_pages_are_dropped_and_gather_restores_positions():
    cfg = tiny_config()
    pool = jnp.zeros((5, 2, 2 * cfg.num_kv_heads, cfg.head_dim))
    table = jnp.asarray([[3, 1, 5]], jnp.int32)  # third page not held (5 = out of range)
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    new = jnp.broadcast_to((jnp.arange(6.0) + 1)[None, :, None, None],
                           (1, 6, cfg.num_kv_heads, cfg.head_dim))
    pool = write_pages(pool, table, pos, new, -new)
    keys, values = split_kv(gather_pages(pool, table, 2), cfg.head_dim)
    np.testing.assert_array_equal(keys[0, :, 0, 0], [1, 2, 3, 4])
    np.testing.assert_array_equal(values[0, :, 1, 0], [-1, -2, -3, -4])
    # keys and values interleave on the head axis: k0 v0 k1 v1
    assert float(pool[3, 0, 0, 0]) == 1 and float(pool[3, 0, 1, 0]) == -1
    assert float(pool[1, 1, 2, 0]) == 4 and float(pool[1, 1, 3, 0]) == -4
    assert float(jnp.abs(pool[jnp.asarray([0, 2, 4])]).sum()) == 0  # nothing else was written


def _oracle_attention(q, pool_k, pool_v, tables, positions):
    """Plain numpy (float64) causal softmax attention of each row's queries over the keys and
    values its page table lists, GQA head h reading kv head h // (H/K)."""
    q, pool_k, pool_v = (np.asarray(a, np.float64) for a in (q, pool_k, pool_v))
    b, t, h, x = q.shape
    k_heads = pool_k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        keys = np.concatenate([pool_k[p] for p in tables[r]])  # [S, K, X], position order
        values = np.concatenate([pool_v[p] for p in tables[r]])
        for i in range(t):
            n = positions[r, i] + 1
            for head in range(h):
                kv = head // (h // k_heads)
                s = keys[:n, kv] @ q[r, i, head] / np.sqrt(x)
                w = np.exp(s - s.max())
                out[r, i, head] = (w / w.sum()) @ values[:n, kv]
    return out


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("stored", [(None, None), (14, 128)], ids=["model", "replicated"])
def test_reference_attention_matches_a_plain_oracle(t, stored):
    """The reference (its gathered view laid out as the dense engine's cache) against a
    float64 loop over each row's logical keys: decode (T = 1) and T > 1 (the extend program),
    seven query heads per kv head (the Qwen2.5-0.5B ratio), ragged positions over shuffled
    pages, pages past a row's position full of junk; the pool storing the model's 2 kv heads,
    or each one 7 times (a tensor axis of 14 > K, one copy per shard) with head_dim padded
    to the TPU kernel's 128 lanes."""
    rng = np.random.default_rng(t)
    b, c, n, k_heads, g, x = 4, 4, 3, 2, 7, 8
    num_pages = b * n + 2
    tables = _random_tables(rng, b, n, num_pages)
    pool_k = rng.normal(size=(num_pages, c, k_heads, x)).astype(np.float32)
    pool_v = rng.normal(size=(num_pages, c, k_heads, x)).astype(np.float32)
    q = (3 * rng.normal(size=(b, t, k_heads * g, x))).astype(np.float32)
    last = np.array([t - 1, 5, 9, n * c - 1])  # each row's last query position
    positions = (last[:, None] - np.arange(t)[::-1][None, :]).astype(np.int32)
    pool = kv_pool(jnp.asarray(pool_k), jnp.asarray(pool_v), *stored)
    out = jax.jit(paged_attention)(q, pool, jnp.asarray(tables), jnp.asarray(positions))
    np.testing.assert_allclose(out, _oracle_attention(q, pool_k, pool_v, tables, positions),
                               atol=2e-6, rtol=1e-5)
