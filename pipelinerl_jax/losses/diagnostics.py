"""Off-policy diagnostics every loss returns, overall and per lag bucket, from the same jit.

Over the N trained tokens (loss_mask > 0), with ρ = π_θ/μ (current vs behaviour),
r = π_θ/π_old (current vs proximal) and w = π_old/μ (proximal vs behaviour):

  ess                  token effective sample size (Σρ)² / (N·Σρ²) ∈ (0, 1] (Kong 1992);
  seq_ess              the same over rows with sequence weights exp(Σ_t m·log ρ_t);
  r_mean/min/max, w_mean/min/max   ratio statistics (w ≡ 1 without a proximal policy);
  clip_frac, clip_{low,high}_frac_{pos,neg}_adv   fraction of trained tokens beyond the loss's
                       lower/upper clip, split by the sign of A (the four add up to clip_frac;
                       a token with A = 0 counts in none; PPO's clip binds on low&neg and
                       high&pos; tis clips high only, gspo per row, reinforce/m2po never);
  masked_frac          trained tokens the loss masked (icepop, m2po) or excluded (staleness_clip);
  kl_k1, kl_k3         KL(μ || π_θ) estimated from the behaviour samples (Schulman 2020):
                       k1 = -log ρ, k3 = ρ - 1 - log ρ;
  entropy              mean per-token entropy, when the learner passes it;
  tokens, lag_mean, lag_max;
  mismatch_abs_mean, mismatch_abs_max, mismatch_frac_above_0.1, mismatch_kl_k3
                       the gap between the sampler's log-probs and the learner's under the
                       weights it starts the update from (the proximal policy, else the
                       current one): d = log π_prox - log μ; mean and max |d|, the fraction
                       of tokens with |d| > 0.1 and k3 = e^d - 1 - d. In the lag-0 bucket
                       those weights ARE the ones that sampled the token, so d is the pure
                       train-inference mismatch (bf16 kernels, another attention, another
                       engine), repeated as `mismatch/<name>` (+ `mismatch/tokens`); at lag > 0
                       it adds the drift of `lag` updates. docs/metrics.md reads them.
Per engine (when the learner passes `engine`, a per-token index into the batch's engine
names), the lag-0 mismatch again as float32[MAX_ENGINES] vectors `engine/<name>`
(`flatten_metrics(..., engine_names)` names them `engine_<id>/<name>`).
Per lag bucket (0, 1, 2, 3-4, 5-8, 9+) the token-level ones again, as ONE float32[6] vector
per name under `lag/<name>` (e.g. `lag/ess`, `lag/tokens`), indexed like LAG_BUCKETS; an empty
bucket reports 0 for everything. Vectors, not ~120 scalars: on XLA:CPU every scalar output is
its own kernel and tripled the compile time. `flatten_metrics` expands them on the host into
scalars `lag_<bucket>/<name>` (e.g. `lag_3-4/kl_k3`) for logging.

Everything is finite for any finite input: per-token ratios (so ESS, the r/w statistics and
k3) come from log-ratios clamped to ±MAX_LOG_RATIO — exact whenever |log ratio| ≤ 20, saturated
beyond; seq_ess is exact (row log-weights shifted by their max). All sums per bucket come from
contractions of [K, B, T] column stacks with the [B, T, 6] bucket one-hot.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelinerl_jax.lag_buckets import LAG_BUCKETS, LOWER_EDGES
from pipelinerl_jax.losses.core import MAX_LOG_RATIO, LossInputs, Prepared, prepare, sg

Array = jax.Array

_BUCKET_LOWER_EDGES = LOWER_EDGES[1:]  # lag >= edge moves a token up one bucket
_CHUNK = 8  # columns per bucket-sum contraction
MAX_ENGINES = 8  # engines with a per-engine mismatch breakdown (the batch's first 8, by name)
MISMATCH_ABOVE = 0.1  # |log π_prox - log μ| counted by mismatch_frac_above_0.1
MISMATCH_KEYS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_frac_above_0.1",
                 "mismatch_kl_k3")
CLIP_KEYS = ("clip_low_frac_pos_adv", "clip_low_frac_neg_adv",
             "clip_high_frac_pos_adv", "clip_high_frac_neg_adv")
# Metrics reported both overall and per lag bucket.
TOKEN_METRICS = ("tokens", "ess", "r_mean", "r_min", "r_max", "w_mean", "w_min", "w_max",
                 "clip_frac") + CLIP_KEYS + ("masked_frac", "kl_k1", "kl_k3") + MISMATCH_KEYS


def lag_bucket(lag: Array) -> Array:
    """Index into LAG_BUCKETS of each token's lag (negative lags count as 0)."""
    bucket = jnp.zeros(lag.shape, jnp.int32)
    for edge in _BUCKET_LOWER_EDGES:
        bucket = bucket + (lag >= edge).astype(jnp.int32)
    return bucket


def _div(num: Array, den: Array) -> Array:
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _group_max(values: list, group: Array, n_groups: int, trained: Array) -> Array:
    """[len(values), n_groups]: the max of each value over the trained tokens of each group
    (group[b, t] its index; -inf where empty), in ONE variadic reduction (a masked max over a
    [B, T, groups] broadcast would be materialised by XLA:CPU)."""
    masks = [trained & (group == i) for i in range(n_groups)]
    operands = tuple(jnp.where(mask, v, -jnp.inf) for v in values for mask in masks)
    maxes = jax.lax.reduce(operands, (jnp.float32(-jnp.inf),) * len(operands),
                           lambda a, b: tuple(jnp.maximum(u, v) for u, v in zip(a, b)), (0, 1))
    return jnp.stack(maxes).reshape(len(values), n_groups)


def _group_sums(columns: list, group: Array, n_groups: int, trained: Array) -> Array:
    """[len(columns), n_groups]: each column summed over the trained tokens of each group, as
    contractions with the group one-hot in chunks of _CHUNK columns (on XLA:CPU one contraction
    of 13+ columns fell off a cliff, 4x slower than two). Untrained tokens are zero in both
    operands, so no inf/NaN of theirs can reach a sum. Contracted over T per row, then the
    rows summed: a contraction over a sharded batch axis would need its output sharding."""
    onehot = ((group[..., None] == jnp.arange(n_groups)) & trained[..., None])
    onehot = onehot.astype(jnp.float32)
    cols = [jnp.where(trained, c, 0.0).astype(jnp.float32) for c in columns]
    return jnp.concatenate([
        jnp.sum(jnp.einsum("kbt,btj->bkj", jnp.stack(cols[i:i + _CHUNK]), onehot), axis=0)
        for i in range(0, len(cols), _CHUNK)])


def _mismatch_columns(d: Array) -> dict:
    """Per-token mismatch columns of the log-ratio d = log π_prox - log μ (summed, then / N)."""
    abs_d = jnp.abs(d)
    return {"mismatch_abs_mean": abs_d, "mismatch_frac_above_0.1": abs_d > MISMATCH_ABOVE,
            "mismatch_kl_k3": jnp.exp(jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)) - 1.0
            - jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)}


def compute(x: Prepared, clip_low: Optional[Array] = None, clip_high: Optional[Array] = None,
            masked: Optional[Array] = None, entropy: Optional[Array] = None,
            engine: Optional[Array] = None) -> dict:
    """The diagnostics of a cleaned batch `x` (see `core.prepare`); all sg."""
    t = x.trained
    bucket = lag_bucket(x.lag)

    def clamp(v):
        return jnp.clip(v, -MAX_LOG_RATIO, MAX_LOG_RATIO)

    rho_log = sg(x.logp) - x.logp_mu
    rho = jnp.exp(clamp(rho_log))
    log_ratios = {"r": sg(x.logp) - x.logp_old, "w": x.logp_old - x.logp_mu}
    if not x.has_proximal:  # r = ρ and w ≡ 1: nothing more to compute
        log_ratios = {"r": rho_log}
    none = jnp.zeros_like(t)
    low = none if clip_low is None else clip_low
    high = none if clip_high is None else clip_high
    pos, neg = x.adv > 0, x.adv < 0
    columns = {
        "tokens": jnp.ones_like(rho), "rho": rho, "rho2": rho * rho,
        "r_mean": rho if not x.has_proximal else jnp.exp(clamp(log_ratios["r"])),
        "kl_k1": -rho_log, "kl_k3": rho - 1.0 - clamp(rho_log),
        "clip_low_frac_pos_adv": low & pos, "clip_low_frac_neg_adv": low & neg,
        "clip_high_frac_pos_adv": high & pos, "clip_high_frac_neg_adv": high & neg,
        "masked_frac": none if masked is None else masked,
    }
    if x.has_proximal:
        columns["w_mean"] = jnp.exp(clamp(log_ratios["w"]))
    if entropy is not None:
        columns["entropy"] = jnp.asarray(entropy, jnp.float32)
    # The mismatch: the sampler against the weights the update starts from.
    mismatch = (x.logp_old if x.has_proximal else sg(x.logp)) - x.logp_mu
    columns.update(_mismatch_columns(mismatch))
    n_buckets = len(LAG_BUCKETS)
    sums = _group_sums(list(columns.values()), bucket, n_buckets, t)
    sums = jnp.concatenate([sums, jnp.sum(sums, axis=1, keepdims=True)], axis=1)  # + overall
    extremes = {}
    for k, v in log_ratios.items():
        extremes.update({f"{k}_max": v, f"{k}_min": -v})
    ext = _group_max(list(extremes.values()) + [jnp.abs(mismatch)], bucket, n_buckets, t)
    ext = jnp.concatenate([ext, jnp.max(ext, axis=1, keepdims=True)], axis=1)
    ext, abs_max = ext[:-1], ext[-1]  # [E, buckets + 1]; -inf: empty

    # Every statistic as a [n_buckets + 1] vector: the buckets, then the whole batch.
    s = dict(zip(columns, sums))
    n = s["tokens"]
    stats = {"tokens": n, "ess": _div(s["rho"] ** 2, n * s["rho2"])}
    for name in columns:
        if name not in ("tokens", "rho", "rho2"):
            stats[name] = _div(s[name], n)
    signs = jnp.asarray([-1.0 if k.endswith("min") else 1.0 for k in extremes])[:, None]
    ext = jnp.where(n > 0, jnp.exp(clamp(signs * ext)), 0.0)
    stats.update(zip(extremes, ext))
    if not x.has_proximal:
        stats["w_mean"] = stats["w_min"] = stats["w_max"] = (n > 0).astype(jnp.float32)
    stats["clip_frac"] = sum(stats[k] for k in CLIP_KEYS)
    stats["mismatch_abs_max"] = jnp.where(n > 0, abs_max, 0.0)

    metrics = {k: v[-1] for k, v in stats.items()}
    metrics.update({f"lag/{k}": v[:-1] for k, v in stats.items()})
    metrics["mismatch/tokens"] = n[0]  # lag 0: the pure train-inference mismatch
    metrics.update({f"mismatch/{k[len('mismatch_'):]}": stats[k][0] for k in MISMATCH_KEYS})
    if engine is not None:
        metrics.update(_per_engine(mismatch, jnp.asarray(engine, jnp.int32), t & (x.lag == 0)))
    lag = x.lag.astype(jnp.float32)  # 0 off the trained tokens
    metrics["lag_mean"] = _div(jnp.sum(lag), metrics["tokens"])
    metrics["lag_max"] = jnp.max(lag)
    metrics["seq_ess"] = sequence_ess(rho_log, x.m)
    return metrics


def _per_engine(mismatch: Array, engine: Array, lag0: Array) -> dict:
    """The lag-0 mismatch per engine index (< MAX_ENGINES) as `engine/<name>` vectors."""
    columns = _mismatch_columns(mismatch)
    sums = _group_sums([jnp.ones_like(mismatch)] + list(columns.values()), engine,
                       MAX_ENGINES, lag0)
    n = sums[0]
    out = {"engine/tokens": n}
    out.update({f"engine/{k}": _div(s, n) for k, s in zip(columns, sums[1:])})
    top = _group_max([jnp.abs(mismatch)], engine, MAX_ENGINES, lag0)[0]
    out["engine/mismatch_abs_max"] = jnp.where(n > 0, top, 0.0)
    return out


def sequence_ess(log_rho: Array, m: Array) -> Array:
    """(Σ_b W_b)² / (B'·Σ_b W_b²), W_b = exp(Σ_t m·log ρ), over the B' rows with trained tokens."""
    has = jnp.sum(m, axis=1) > 0
    log_w = jnp.where(has, jnp.sum(m * log_rho, axis=1), -jnp.inf)
    top = jnp.max(log_w)
    w = jnp.where(has, jnp.exp(log_w - jnp.where(jnp.any(has), top, 0.0)), 0.0)
    return _div(jnp.sum(w) ** 2, jnp.sum(has) * jnp.sum(w * w))


def flatten_metrics(metrics: Mapping, engine_names: Sequence[str] = ()) -> dict:
    """Host-side: metrics as Python floats, each `lag/<name>` vector expanded into
    `lag_<bucket>/<name>` scalars (the layout TensorBoard / JSONL logging wants), and each
    `engine/<name>` vector into `engine_<id>/<name>` for the engines of `engine_names` (the
    batch's engine index -> engine id) that have lag-0 tokens."""
    flat = {}
    for key, value in metrics.items():
        value = np.asarray(value)
        if key.startswith("lag/") and value.shape == (len(LAG_BUCKETS),):
            for bucket, v in zip(LAG_BUCKETS, value):
                flat[f"lag_{bucket}/{key[4:]}"] = float(v)
        elif key.startswith("engine/") and value.shape == (MAX_ENGINES,):
            tokens = np.asarray(metrics["engine/tokens"])
            for i, name in enumerate(engine_names[:MAX_ENGINES]):
                if tokens[i] > 0:
                    flat[f"engine_{name}/{key[7:]}"] = float(value[i])
        else:
            flat[key] = float(value)
    return flat


def off_policy_diagnostics(inputs: LossInputs) -> dict:
    """The loss-independent diagnostics of a batch (no clip or mask information), e.g. for an
    evaluation pass; every loss returns these plus its clip/mask fractions."""
    return compute(prepare(inputs), entropy=inputs.entropy, engine=inputs.engine)
