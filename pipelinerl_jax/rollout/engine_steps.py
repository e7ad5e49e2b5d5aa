"""The jitted device programs of `JaxEngine`: batched prefill, multi-step decode, slot release.

Device state is a dense KV cache of `max_slots` rows × `max_seq_len` positions (in the
engine layout of `decode_step`) plus a
`SlotState` holding, per slot, the pending token (sampled, its K/V not yet written), its
position and the slot's sampling parameters. Everything stays on device between calls; a
call returns only the sampled tokens and log-probs.

* `prefill(params, cache, slots, ids, lengths, slot_idx, rows)` runs right-padded prompts
  `[Bp, T]` through the model with a fresh `[Bp, T]` cache, copies those K/V rows into the
  big cache at `slot_idx` (rows with an out-of-range slot are padding and are dropped), takes
  the logits at each prompt's last position and samples its first token. A re-prefill of a
  prompt plus the tokens generated so far (kv_policy='recompute') is the same call.
* `decode(params, cache, slots, refill_at)` runs up to `steps` decode steps in one
  `lax.while_loop`: each step feeds every active slot's pending token at its position and
  samples the next. A slot that samples a stop id or reaches its length limit freezes; the
  loop exits early when no slot is active, or, when `refill_at > 0`, as soon as that many
  slots have finished (so queued samples get the free slots without waiting for the rest of
  the chunk; waiting for a few frees at a time batches their prefill).
  Attention runs over the first `cache_len` positions only (a static bucket > every active
  position written in the chunk), not over all `max_seq_len` (see `decode_step`).

With `page_size > 0` (`engine.kv_layout='paged'`) the device cache is a page pool per layer
(`models.paged_attention`) instead, and `prefill` / `decode` take one more argument, the page
tables of their rows (`[Bp, N]` / `[S, N]` int32, owned by the host's `PageAllocator` and
sent with every call; out-of-range entries are pages a row does not hold, where writes are
dropped). Prefill scatters the fresh K/V into the rows' pages; decode writes each step's K/V
into the page of its position and attends over the first `ceil(cache_len / page_size)` pages.
Inactive slots write at a position past every table (dropped). Decode there runs over the
first `rows` slots only (a static row bucket): the scheduler packs running samples into the
lowest slots (`permute` moves slot state; their K/V stays in its pages, only the page-table
row moves), so a long tail of few samples does not pay for every slot. `start` begins
the samples of a group on their shared prompt prefix (`rollout/prompt_share.py`): it copies
each one's copy-on-write page and sets its slot state (pending token = the prompt's last
token), with no prefill of its own. `extend(params, cache, slots, ids, starts, lengths,
slot_idx, rows, tables)` is a prefill over existing pages: row b's tokens are positions
`[starts[b], starts[b] + lengths[b])` of a sequence whose K/V before `starts[b]` are already
in the pages its table lists (a retained prefix, `rollout/prefix_cache.py`, or its group's
shared prompt); the model's paged cached forward writes the new positions' K/V into its
pages and attends over the whole table (the reference paged attention, not a Pallas kernel),
then samples the token after the last one as `prefill` does.

Shapes are static per (prefill batch bucket, prompt-length bucket) and per cache-length
bucket, so steady-state serving compiles nothing new. The compiled programs are cached per
(model config, engine shape) at module level, so engines of the same shape share them.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pipelinerl_jax.models import Decoder, KVCache, init_cache
from pipelinerl_jax.models.lora import add_lora
from pipelinerl_jax.models.decoder_config import ModelConfig
from pipelinerl_jax.models.paged_attention import write_pages
from pipelinerl_jax.rollout.decode_step import decode_logits, write_rows
from pipelinerl_jax.rollout.sampling import RowParams, is_stop, sample


class SlotState(NamedTuple):
    token: jax.Array  # int32 [S]: pending token (sampled, K/V not yet written)
    pos: jax.Array  # int32 [S]: sequence position of the pending token
    active: jax.Array  # bool [S]
    rows: RowParams  # per-slot sampling parameters


def admitted(slots, slot_idx_b, token_b, pos_b, done_b, rows):
    """`slots` with rows `slot_idx_b` set to freshly prefilled samples: their first sampled
    token, its position, still active unless done, their request parameters (indices past
    the slots, i.e. padding rows, are dropped)."""
    def scatter(dst, src):
        return dst.at[slot_idx_b].set(src, mode="drop")
    return SlotState(token=scatter(slots.token, token_b), pos=scatter(slots.pos, pos_b),
                     active=scatter(slots.active, ~done_b),
                     rows=jax.tree.map(scatter, slots.rows, rows))


def empty_slots(num_slots: int, max_stop_tokens: int) -> SlotState:
    def z():  # a distinct buffer per field: donated fields must not alias
        return jnp.zeros((num_slots,), jnp.int32)
    return SlotState(
        token=z(), pos=z(), active=jnp.zeros((num_slots,), bool),
        rows=RowParams(seed=jnp.zeros((num_slots,), jnp.uint32), sample_index=z(),
                       temperature=jnp.ones((num_slots,), jnp.float32),
                       top_p=jnp.ones((num_slots,), jnp.float32), top_k=z(),
                       stop_ids=jnp.full((num_slots, max_stop_tokens), -1, jnp.int32),
                       limit=z()))


class StepFns(NamedTuple):
    prefill: callable
    # decode(params, cache, slots, refill_at[, tables], cache_len=static, rows=static)
    decode: callable
    release: callable
    permute: callable  # permute(slots, perm): slot state rows reordered (paged compaction)
    # start(cache, slots, src, dst, slot_idx, token, pos, rows): shared-prompt samples start
    # (paged: copy-on-write page copies, then pending token / position / rows per slot)
    start: callable
    # extend(params, cache, slots, ids, starts, lengths, slot_idx, rows, tables): paged only,
    # a prefill of positions [start, start + length) over pages holding [0, start)
    extend: callable = None


@functools.lru_cache(maxsize=None)
def step_fns(model_cfg: ModelConfig, max_seq_len: int, steps: int, logprob_mode: str,
             cache_sharding, replicated, page_size: int = 0,
             attention_kernel: str = "reference", lora=None) -> StepFns:
    """Jitted programs for one engine shape (cached for the process's lifetime: engines of
    one shape share executables); `page_size > 0`: over a paged cache, decode attention
    through `attention_kernel` (a resolved `engine.attention_kernel`,
    `models/paged_kernels.py`); `lora` (a `LoRASpec`): the model carries adapters, applied
    unmerged in every forward (`models.model.lora_delta`)."""
    def build():
        model = Decoder(model_cfg, nnx.Rngs(0))
        return model if lora is None else add_lora(model, lora, nnx.Rngs(0))

    graphdef = nnx.split(nnx.eval_shape(build))[0]
    # where inactive slots write: past the end of the dense cache / of every page table
    nowhere = -(-max_seq_len // page_size) * page_size if page_size else max_seq_len

    def prefill(params, cache: KVCache, slots: SlotState, ids_bt, lengths_b, slot_idx_b,
                rows: RowParams, tables_bn=None):
        model = nnx.merge(graphdef, params)
        b, t = ids_bt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        fresh = init_cache(model_cfg, b, t, dtype=jax.tree.leaves(cache)[0].dtype)
        h_btd, fresh = model.hidden_states(ids_bt, positions, fresh)
        h_bd = h_btd[jnp.arange(b), lengths_b - 1]
        logits_bv = model.logits_from_hidden(h_bd)
        token_b, logp_b = sample(logits_bv, rows, lengths_b, logprob_mode)
        done_b = is_stop(token_b, rows.stop_ids) | (lengths_b + 1 >= rows.limit)

        if tables_bn is None:
            cache = write_rows(cache, fresh, slot_idx_b)
        else:  # padding rows' tables hold no page: their writes are dropped
            cache = cache._replace(kv=tuple(
                write_pages(pool, tables_bn, positions, k, v)
                for pool, k, v in zip(cache.kv, fresh.k, fresh.v)))

        slots = admitted(slots, slot_idx_b, token_b, lengths_b, done_b, rows)
        return cache, slots, (token_b, logp_b, done_b)

    def extend(params, cache, slots: SlotState, ids_bt, starts_b, lengths_b, slot_idx_b,
               rows: RowParams, tables_bn):
        """`prefill` of positions `starts_b + [0, T)` over the pages in `tables_bn` (which
        hold each row's K/V below `starts_b`): the paged cached forward writes the new K/V
        and attends to the old; the token after position `starts_b + lengths_b - 1` is
        sampled (module docstring)."""
        model = nnx.merge(graphdef, params)
        b, t = ids_bt.shape
        positions = starts_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        h_btd, paged = model.hidden_states(ids_bt, positions,
                                           cache._replace(page_table=tables_bn))
        cache = cache._replace(kv=paged.kv)
        logits_bv = model.logits_from_hidden(h_btd[jnp.arange(b), lengths_b - 1])
        ends_b = starts_b + lengths_b
        token_b, logp_b = sample(logits_bv, rows, ends_b, logprob_mode)
        done_b = is_stop(token_b, rows.stop_ids) | (ends_b + 1 >= rows.limit)

        slots = admitted(slots, slot_idx_b, token_b, ends_b, done_b, rows)
        return cache, slots, (token_b, logp_b, done_b)

    def decode(params, cache: KVCache, slots: SlotState, refill_at, tables_bn=None, *,
               cache_len: int, rows=None):
        if rows is not None:  # only the first `rows` slots (the paged layout packs them)
            cache, head, out = decode(params, cache, jax.tree.map(lambda x: x[:rows], slots),
                                      refill_at, tables_bn, cache_len=cache_len)
            slots = jax.tree.map(lambda full, part: full.at[:rows].set(part), slots, head)
            tok, logp, emit, active, n = out
            return cache, slots, (tok, logp, emit, slots.active, n)
        model = nnx.merge(graphdef, params)
        num_slots = slots.token.shape[0]
        out_tok = jnp.zeros((steps, num_slots), jnp.int32)
        out_logp = jnp.zeros((steps, num_slots), jnp.float32)
        out_emit = jnp.zeros((steps, num_slots), bool)

        def body(carry):
            i, cache, slots, finished, out_tok, out_logp, out_emit = carry
            active = slots.active
            # Inactive rows write past the end of the cache: the scatter drops it.
            pos = jnp.where(active, slots.pos, nowhere)
            logits, cache = decode_logits(model, slots.token, pos, cache, cache_len, tables_bn,
                                          attention_kernel)
            token, logp = sample(logits, slots.rows, slots.pos + 1, logprob_mode)
            done = active & (is_stop(token, slots.rows.stop_ids)
                             | (slots.pos + 2 >= slots.rows.limit))
            slots = slots._replace(token=jnp.where(active, token, slots.token),
                                   pos=jnp.where(active, slots.pos + 1, slots.pos),
                                   active=active & ~done)
            return (i + 1, cache, slots, finished + jnp.sum(done, dtype=jnp.int32),
                    out_tok.at[i].set(token), out_logp.at[i].set(logp),
                    out_emit.at[i].set(active))

        def cond(carry):
            i, _, slots, finished = carry[:4]
            refill = (refill_at > 0) & (finished >= refill_at)
            return (i < steps) & jnp.any(slots.active) & ~refill

        init = (jnp.int32(0), cache, slots, jnp.int32(0), out_tok, out_logp, out_emit)
        n, cache, slots, _, out_tok, out_logp, out_emit = jax.lax.while_loop(cond, body, init)
        return cache, slots, (out_tok, out_logp, out_emit, slots.active, n)

    def release(slots: SlotState, free_b):
        """Deactivates the slots where `free_b` is set (aborted requests)."""
        return slots._replace(active=slots.active & ~free_b)

    def permute(slots: SlotState, perm_s):
        """Slot `i` takes slot `perm_s[i]`'s state (a permutation)."""
        return jax.tree.map(lambda x: x[perm_s], slots)

    def start(cache, slots: SlotState, src_s, dst_s, slot_idx_s, token_s, pos_s,
              rows: RowParams):
        """Starts samples on a shared prompt prefix (`rollout/prompt_share.py`): copies page
        `src_s[i]` to page `dst_s[i]` in every layer's pools (an out-of-range destination
        copies nothing), then makes slot `slot_idx_s[i]` active with pending token
        `token_s[i]` at position `pos_s[i]` (out-of-range slots are padding)."""
        def copy(pool):
            return pool.at[dst_s].set(jnp.take(pool, src_s, axis=0, mode="clip"), mode="drop")
        cache = cache._replace(kv=tuple(map(copy, cache.kv)))

        def scatter(dst, src):
            return dst.at[slot_idx_s].set(src, mode="drop")
        slots = SlotState(token=scatter(slots.token, token_s), pos=scatter(slots.pos, pos_s),
                          active=scatter(slots.active, jnp.ones(slot_idx_s.shape, bool)),
                          rows=jax.tree.map(scatter, slots.rows, rows))
        return cache, slots

    # Outputs keep the inputs' placement, so donated buffers are reused and the next call
    # sees the same shardings (a mismatch costs a slow path on every call).
    out = (cache_sharding, replicated, replicated)
    return StepFns(
        prefill=jax.jit(prefill, donate_argnums=(1, 2), out_shardings=out),
        decode=jax.jit(decode, donate_argnums=(1, 2), static_argnames=("cache_len", "rows"),
                       out_shardings=out),
        release=jax.jit(release, donate_argnums=(0,), out_shardings=replicated),
        permute=jax.jit(permute, donate_argnums=(0,), out_shardings=replicated),
        start=jax.jit(start, donate_argnums=(0, 1), out_shardings=(cache_sharding, replicated)),
        extend=(jax.jit(extend, donate_argnums=(1, 2), out_shardings=out) if page_size
                else None))
