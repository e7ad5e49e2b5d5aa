"""Time models: one decode step, prefill, one train step, and the KV-cache capacity.

Decode step of an engine running `B` sequences holding `C` cached tokens in total (the
roofline model; Williams et al. 2009, applied to LLM decoding as in "LLM Inference Unveiled",
Yuan et al. 2024). An engine spans `tp` devices (tensor parallel: bandwidth and FLOP/s add up):

    t_mem = (weights + kv_bytes_per_token · C) / (tp · hbm_bw · mbu)          memory-bound
    t_cmp = (2 · params · B + attn_flops_per_ctx · C) / (tp · peak · mfu)       compute-bound
    t     = overhead + (t_mem^p + t_cmp^p)^(1/p)

`p` (`latency.sharpness`) sets how sharp the knee between the regimes is: p = inf is the hard
roofline max(t_mem, t_cmp); the default p = 4 is within 19% of it at the knee and within
1e-4 once one term is 10x the other. p = 1 makes t linear in B and C, which is the form a
calibration fits (`t = a + b·B + c·C`), so both share this class.

Prefill of `P` prompt tokens rides along a decode step (chunked prefill): the weights are
already being read, so it costs the compute of `P` extra sequences, `P · cmp_per_seq`.

Train step on `n` devices over `T` tokens (forward + backward = 6 FLOPs per parameter per
token, Kaplan et al. 2020): `fixed + 6 · params · T / (n · peak · train_mfu)`.

KV capacity of one engine, in tokens: `(tp · hbm · hbm_util − weights) / kv_bytes_per_token`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pipelinerl_jax.sim.hardware import Accelerator, ModelSpec


@dataclasses.dataclass(frozen=True)
class DecodeLatency:
    """Per-step decode time of one engine; all coefficients in seconds."""
    mem_fixed_s: float  # weight bytes over bandwidth
    mem_per_ctx_s: float  # per cached token
    cmp_per_seq_s: float  # per running sequence (or per prefilled token)
    cmp_per_ctx_s: float  # attention, per cached token
    sharpness: float = 4.0
    overhead_s: float = 0.0

    @classmethod
    def roofline(cls, acc: Accelerator, model: ModelSpec, tp: int = 1,
                 sharpness: float = 4.0, overhead_s: float = 0.0) -> "DecodeLatency":
        bw = tp * acc.hbm_bw * acc.mbu
        flops = tp * acc.peak_flops * acc.mfu
        return cls(mem_fixed_s=model.weights_total_bytes / bw,
                   mem_per_ctx_s=model.kv_bytes_per_token / bw,
                   cmp_per_seq_s=2.0 * model.params / flops,
                   cmp_per_ctx_s=model.attn_flops_per_token_per_ctx / flops,
                   sharpness=sharpness, overhead_s=overhead_s)

    def memory_time(self, ctx_tokens):
        return self.mem_fixed_s + self.mem_per_ctx_s * np.asarray(ctx_tokens, np.float64)

    def compute_time(self, batch, ctx_tokens):
        return (self.cmp_per_seq_s * np.asarray(batch, np.float64)
                + self.cmp_per_ctx_s * np.asarray(ctx_tokens, np.float64))

    def step_time(self, batch, ctx_tokens):
        """Seconds per decode step for `batch` sequences holding `ctx_tokens` in total."""
        t_mem = self.memory_time(ctx_tokens)
        t_cmp = self.compute_time(batch, ctx_tokens)
        p = self.sharpness
        if np.isinf(p):
            t = np.maximum(t_mem, t_cmp)
        elif p == 1.0:
            t = t_mem + t_cmp
        else:
            # Factor out the larger term so the power cannot overflow.
            hi = np.maximum(t_mem, t_cmp)
            lo = np.minimum(t_mem, t_cmp)
            t = hi * (1.0 + (lo / np.where(hi > 0, hi, 1.0)) ** p) ** (1.0 / p)
        return self.overhead_s + t

    def prefill_time(self, prompt_tokens):
        return self.cmp_per_seq_s * np.asarray(prompt_tokens, np.float64)

    def knee_batch(self, ctx_per_seq: float) -> float:
        """Batch size where t_mem = t_cmp at `ctx_per_seq` cached tokens per sequence."""
        per_seq_cmp = self.cmp_per_seq_s + self.cmp_per_ctx_s * ctx_per_seq
        per_seq_mem = self.mem_per_ctx_s * ctx_per_seq
        if per_seq_cmp <= per_seq_mem:
            return np.inf
        return self.mem_fixed_s / (per_seq_cmp - per_seq_mem)


@dataclasses.dataclass(frozen=True)
class TrainTime:
    """Train-step time: `fixed_s + per_token_device_s · tokens / n_devices`."""
    fixed_s: float
    per_token_device_s: float

    @classmethod
    def roofline(cls, acc: Accelerator, model: ModelSpec, flops_per_param_token: float = 6.0,
                 fixed_s: float = 0.0) -> "TrainTime":
        return cls(fixed_s, flops_per_param_token * model.params / (acc.peak_flops * acc.train_mfu))

    def step_time(self, tokens, n_devices: int):
        return self.fixed_s + self.per_token_device_s * np.asarray(tokens, np.float64) / n_devices


def kv_capacity_tokens(acc: Accelerator, model: ModelSpec, tp: int = 1) -> float:
    """Tokens of KV cache one engine of `tp` devices holds after its weights."""
    return (tp * acc.hbm_bytes * acc.hbm_util - model.weights_total_bytes) / model.kv_bytes_per_token
