"""A pool of inference engines doing continuous batching, simulated in decode-step space.

Each engine has `slots` sequence slots (its KV-cache-limited batch size). Every decode step,
every running sequence gains one token; a slot that frees is refilled at once from the
engine's admission allowance (round-robin dispatch: global group g goes to engine g % E, so
an engine may admit the samples of its groups below the global cap the driver sets).

Why decode-step space: between two admissions/completions nothing changes but the growing
KV, so an engine's schedule in *steps* is a list-scheduling problem that does not depend on
time at all. `advance` therefore
  1. fills slots in rounds (each round hands the next sample to every slot that frees before
     the step budget, in order of its free step when the allowance is short) -- one numpy
     pass per round, a handful of rounds per chunk;
  2. integrates time over the steps on a grid of at most `grid_bins` bins per engine: per
     bin the exact token-steps and cached-token-steps of all segments give the mean batch B
     and cached tokens C, and the bin costs `width · step_time(B, C)` plus the prefill of the
     samples admitted in it (`latency.py`);
  3. cuts each engine at the step where its clock reaches the horizon; admissions after
     the cut are undone, sequences running across it carry over.
Cost per chunk is O(slots + admissions) numpy work, independent of the number of decode
steps, which is what makes 1,000 RL steps of 8k samples run in seconds.

Approximations, all second order: a bin uses the latency of its mean (B, C) (t is linear in C
and piecewise linear in B); a sample's tokens are generated one per step from its admission
step (prefill is charged as extra compute in that step); when the allowance is short, slots
are served in order of free step within a round, not across rounds.
"""
from __future__ import annotations

import numpy as np

from pipelinerl_jax.sim.latency import DecodeLatency
from pipelinerl_jax.sim.lengths import LengthDistribution
from pipelinerl_jax.sim.timeline import TimeSeries

_UNBOUNDED = 1 << 50  # step budget of an engine with no horizon


def _sum_range(a, b):
    """Σ_{n=a}^{b-1} n, elementwise."""
    return (a + b - 1) * (b - a) * 0.5


class EnginePool:
    def __init__(self, n_engines: int, slots: int, latency: DecodeLatency,
                 lengths: LengthDistribution, prompt_len: int, group_size: int,
                 rng: np.random.Generator, series: TimeSeries | None = None,
                 prefill_tokens_per_sample: float | None = None, grid_bins: int = 64):
        self.E, self.S = int(n_engines), int(slots)
        self.latency, self.lengths, self.rng, self.series = latency, lengths, rng, series
        self.P, self.G = int(prompt_len), int(group_size)
        # With prefix sharing the G samples of a prompt prefill it once.
        self.prefill_per_sample = float(prompt_len if prefill_tokens_per_sample is None
                                        else prefill_tokens_per_sample)
        self.grid_bins = int(grid_bins)
        n = self.E * self.S
        self.slot_eng = np.repeat(np.arange(self.E), self.S)
        self.rem = np.zeros(n, np.int64)  # tokens left of the slot's sample (0: empty)
        self.ctx = np.zeros(n, np.int64)  # tokens in the slot's KV cache
        self.sid = np.full(n, -1, np.int64)
        self.clock = np.zeros(self.E)
        self.admitted = np.zeros(self.E, np.int64)  # samples admitted so far, per engine
        self.allowed = np.zeros(self.E, np.int64)  # samples admissible so far, per engine
        self.decode_tokens = 0
        self.drawn = 0  # lengths drawn (admissions undone at a cut included)
        self._buf, self._buf_pos = np.zeros(0, np.int64), 0

    # -- admission control -------------------------------------------------------------
    def set_group_cap(self, cap: float):
        """Engines may admit the samples of every global group with id < cap."""
        if np.isinf(cap):
            self.allowed[:] = _UNBOUNDED
            return
        e = np.arange(self.E)
        groups = np.maximum(0, (int(cap) - e + self.E - 1) // self.E)
        self.allowed = groups * self.G

    def sample_ids(self, engine, local):
        """Global sample id of an engine's `local`-th admission: group (local//G)·E + engine."""
        group, member = np.divmod(local, self.G)
        return (group * self.E + engine) * self.G + member

    def _draw(self, n: int) -> np.ndarray:
        """Next n response lengths, drawn in blocks (one RNG call per ~64k samples)."""
        if self._buf_pos + n > self._buf.size:
            block = max(n, 1 << 16)
            self._buf = np.concatenate([self._buf[self._buf_pos:],
                                        self.lengths.sample(self.rng, block)])
            self._buf_pos = 0
        out = self._buf[self._buf_pos: self._buf_pos + n]
        self._buf_pos += n
        self.drawn += n
        return out

    def snapshot(self):
        """The pool's state, for `restore` (to undo an `advance`; `series` is not covered)."""
        return (self.rem.copy(), self.ctx.copy(), self.sid.copy(), self.clock.copy(),
                self.admitted.copy(), self.allowed.copy(), self.decode_tokens, self.drawn,
                self._buf, self._buf_pos, self.rng.bit_generator.state)

    def restore(self, snap):
        """Back to a `snapshot` (each is restored at most once: its arrays become the pool's)."""
        (self.rem, self.ctx, self.sid, self.clock, self.admitted, self.allowed,
         self.decode_tokens, self.drawn, self._buf, self._buf_pos, state) = snap
        self.rng.bit_generator.state = state

    @property
    def active_count(self) -> int:
        return int((self.rem > 0).sum())

    # -- simulation ---------------------------------------------------------------------
    def advance(self, horizon: float):
        """Runs each engine from its clock to `horizon` (np.inf: until out of work).

        Returns (admitted_sids, admit_times, admitted_lengths, finished_sids, finish_times).
        """
        out = [[] for _ in range(5)]
        # A clock within a rounding error of the horizon has arrived.
        arrive = horizon - 1e-9 * max(1.0, horizon) if np.isfinite(horizon) else horizon
        for _ in range(10_000):
            busy = (self.rem > 0).reshape(self.E, self.S).any(1)
            need = (self.clock < arrive) & (busy | (self.admitted < self.allowed))
            if not need.any():
                break
            for acc, part in zip(out, self._chunk(horizon, need)):
                acc.append(part)
        else:  # pragma: no cover - a budget estimate that never reaches the horizon
            raise RuntimeError("engine pool made no progress towards the horizon")
        if np.isfinite(horizon):
            self.clock = np.maximum(self.clock, horizon)  # idle engines wait
        types = (np.int64, np.float64, np.int64, np.int64, np.float64)
        return tuple(np.concatenate(x) if x else np.zeros(0, t) for x, t in zip(out, types))

    def _chunk(self, horizon: float, need: np.ndarray):
        E, S, lat = self.E, self.S, self.latency
        eng = self.slot_eng
        active = self.rem > 0
        slots_c = np.flatnonzero(active)
        eng_c = eng[slots_c]
        ends_c = self.rem[slots_c]
        b0 = np.bincount(eng_c, minlength=E).astype(np.float64)
        c0 = np.bincount(eng_c, self.ctx[slots_c], minlength=E)

        # Step budget: enough steps to pass the horizon at the current pace, with margin.
        allow_left = np.where(need, self.allowed - self.admitted, 0)
        if np.isfinite(horizon):
            # Pace of the batch once free slots are refilled (refills keep it there).
            b_fill = np.minimum(S, b0 + allow_left)
            c_fill = np.maximum(c0, self.P) * b_fill / np.maximum(b0, 1)
            t_step = lat.step_time(np.maximum(b_fill, 1), c_fill)
            budget = np.floor((horizon - self.clock) / t_step * 1.1) + 16
            # The budget only bounds admissions; an engine that may admit nothing just
            # drains, and the cut finds where it stands at the horizon.
            budget = np.where(allow_left > 0, np.minimum(budget, _UNBOUNDED), _UNBOUNDED)
            budget = np.where(need, budget, 0).astype(np.int64)
        else:
            budget = np.where(need, _UNBOUNDED, 0).astype(np.int64)

        # 1. Fill slots in rounds. Each slot's current segment [s, e) holds c0 cached tokens at
        # step s, adding 1 to the batch B and (c0 - s) + n to the cached tokens C at steps
        # s <= n < e; `icpt` is its c0 - s. A new sample starts where the slot's previous
        # one ended, so one event per admission records the change of (B, icpt) there.
        free_at = self.rem.copy()
        live = active.copy()
        icpt = np.where(active, self.ctx, 0).astype(np.float64)
        new_slot, new_start, new_len, ev_db, ev_di = [], [], [], [], []
        cand = np.flatnonzero((free_at < budget[eng]) & (allow_left[eng] > 0))
        while cand.size:
            e = eng[cand]
            cnt = np.bincount(e, minlength=E)
            if np.any(cnt > allow_left):  # short allowance: serve slots by free step
                cand = cand[_order_by(e, free_at[cand])]
                e = eng[cand]
                rank = np.arange(cand.size) - (np.cumsum(cnt) - cnt)[e]
                keep = rank < allow_left[e]
                cand, e = cand[keep], e[keep]
                cnt = np.bincount(e, minlength=E)
            lengths = self._draw(cand.size)
            start = free_at[cand]
            was = live[cand]
            fresh_icpt = self.P - start.astype(np.float64)
            ev_db.append(1.0 - was)
            ev_di.append(fresh_icpt - icpt[cand] * was)
            icpt[cand] = fresh_icpt
            live[cand] = True
            new_slot.append(cand)
            new_start.append(start)
            new_len.append(lengths)
            allow_left -= cnt
            free_at[cand] = start + lengths
            cand = cand[(free_at[cand] < budget[e]) & (allow_left[e] > 0)]
        new_slot = np.concatenate(new_slot) if new_slot else np.zeros(0, np.int64)
        new_start = np.concatenate(new_start) if new_start else np.zeros(0, np.int64)
        new_end = new_start + (np.concatenate(new_len) if new_len else 0)
        new_eng = eng[new_slot]

        # 2. Integrate time on a per-engine grid of decode steps.
        extent = np.minimum(budget, free_at.reshape(E, S).max(1))  # last busy step
        width = max(1, -(-int(extent.max()) // self.grid_bins))  # steps per bin
        nb = max(1, -(-int(extent.max()) // width))
        k_lo = np.arange(nb) * width
        w = np.clip(extent[:, None] - k_lo[None, :], 0, width).astype(np.float64)  # [E, nb]
        size = E * nb

        # Events: admissions (change of B and icpt where a sample starts) and the end of each
        # slot's last segment. Carried segments start at step 0 (added per engine below);
        # events past an engine's extent are clamped onto it, where they weigh nothing.
        n_new = new_start.size
        last = np.flatnonzero(live)
        ev_e = np.concatenate([new_eng, eng[last]])
        ev_x = np.minimum(np.concatenate([new_start, free_at[last]]), extent[ev_e])
        ev_d = np.concatenate(ev_db + [-np.ones(last.size)])
        ev_i = np.concatenate(ev_di + [-icpt[last]])
        k = np.minimum(ev_x // width, nb - 1)
        flat = ev_e * nb + k
        left = np.minimum((k + 1) * width, extent[ev_e]) - ev_x  # steps left in the bin
        ev_x = ev_x.astype(np.float64)
        d_bin = np.bincount(flat, ev_d, size).reshape(E, nb)
        i_bin = np.bincount(flat, ev_i, size).reshape(E, nb)
        b_in = np.bincount(flat, ev_d * left, size).reshape(E, nb)
        c_in = np.bincount(flat, (ev_i + ev_d * (ev_x + (left - 1) * 0.5)) * left, size).reshape(E, nb)
        d_bin[:, 0] += b0
        i_bin[:, 0] += c0
        b_in[:, 0] += b0 * w[:, 0]
        c_in[:, 0] += c0 * w[:, 0] + b0 * _sum_range(0.0, w[:, 0])
        b_start = np.cumsum(d_bin, 1) - d_bin  # batch at each bin's first step
        i_start = np.cumsum(i_bin, 1) - i_bin
        tok = b_start * w + b_in  # token-steps in the bin
        ctx_steps = i_start * w + b_start * _sum_range(k_lo[None, :], k_lo[None, :] + w) + c_in
        safe_w = np.where(w > 0, w, 1.0)
        t_bin = np.where(w > 0, w * lat.step_time(tok / safe_w, ctx_steps / safe_w), 0.0)
        if n_new:
            t_bin += (np.bincount(flat[:n_new], minlength=size).reshape(E, nb)
                      * lat.prefill_time(self.prefill_per_sample))
        t_cum = np.cumsum(t_bin, 1)
        t_beg = t_cum - t_bin

        # 3. Cut each engine where its clock reaches the horizon (within a rounding error, as
        # in `advance`: a sample finishing there is done, one starting there is not).
        room = horizon - (1e-9 * max(1.0, horizon) if np.isfinite(horizon) else 0.0) - self.clock
        reached = t_cum[:, -1] >= room
        cut = extent.copy()
        if np.isfinite(horizon) and reached.any():
            r = np.flatnonzero(reached)
            kb = np.minimum((t_cum[r] < room[r, None]).sum(1), nb - 1)
            frac = (room[r] - t_beg[r, kb]) / np.where(t_bin[r, kb] > 0, t_bin[r, kb], 1.0)
            cut[r] = np.minimum(extent[r], k_lo[kb] + np.ceil(frac * w[r, kb]).astype(np.int64))
        # Time is linear within a bin: T(x) = clock + base + rate·x for x in (k·w, (k+1)·w].
        rate = t_bin / safe_w
        base_f = (self.clock[:, None] + t_beg - rate * k_lo[None, :]).ravel()
        rate_f = rate.ravel()

        def time_at(e, x):  # the engine's time when x steps of this chunk are done
            i = e * nb + np.clip((x - 1) // width, 0, nb - 1)
            return base_f[i] + rate_f[i] * x

        # Carried sequences.
        ran = cut[eng_c]
        done_c = ends_c <= ran
        self.decode_tokens += int(np.minimum(ends_c, ran).sum())
        fin_sid_c = self.sid[slots_c[done_c]]
        fin_e_c, fin_x_c = eng_c[done_c], ends_c[done_c]
        self.rem[slots_c] = np.where(done_c, 0, ends_c - ran)
        self.ctx[slots_c] = np.where(done_c, 0, self.ctx[slots_c] + ran)
        self.sid[slots_c[done_c]] = -1

        # New sequences admitted before the cut get ids in order of admission step.
        keep = np.flatnonzero(new_start < cut[new_eng])
        keep = keep[_order_by(new_eng[keep], new_start[keep])]
        ns, ne, nsl, neng = new_start[keep], new_end[keep], new_slot[keep], new_eng[keep]
        cnt = np.bincount(neng, minlength=E)
        local = self.admitted[neng] + np.arange(ns.size) - (np.cumsum(cnt) - cnt)[neng]
        self.admitted += cnt
        sids = self.sample_ids(neng, local)
        nc = cut[neng]
        done_n = ne <= nc
        run = np.flatnonzero(~done_n)
        nc_r, slot_r = nc[run], nsl[run]
        self.rem[slot_r] = ne[run] - nc_r
        self.ctx[slot_r] = self.P + nc_r - ns[run]
        self.sid[slot_r] = sids[run]
        self.decode_tokens += int((np.minimum(ne, nc) - ns).sum())

        # One lookup for every time needed: finishes (carried, new), admissions, clocks.
        n_fc, n_fn = fin_x_c.size, int(done_n.sum())
        all_e = np.concatenate([fin_e_c, neng[done_n], neng, np.arange(E)])
        all_x = np.concatenate([fin_x_c, ne[done_n], ns, cut])
        times = time_at(all_e, all_x)
        fin_t = times[: n_fc + n_fn]
        admit_t = times[n_fc + n_fn: -E]
        new_clock = np.where(need, times[-E:], self.clock)

        # Record the chunk's bins (up to the cut) and move the clocks.
        if self.series is not None:
            f = np.clip((cut[:, None] - k_lo[None, :]) / safe_w, 0.0, 1.0) * (w > 0)
            a = self.clock[:, None] + t_beg
            self.series.add(a, a + t_bin * f, tokens=tok * f,
                            slot_seconds=tok / safe_w * t_bin * f)
        self.clock = new_clock
        return (sids, admit_t, ne - ns, np.concatenate([fin_sid_c, sids[done_n]]), fin_t)


def _order_by(engine, step):
    """Indices sorting by (engine, step), ties by position; one sort of packed int64 keys."""
    n = engine.size
    if n == 0:
        return np.zeros(0, np.int64)
    span = int(step.max()) + 1
    key = (engine.astype(np.int64) * span + step) * n + np.arange(n)
    return np.sort(key) % n
