"""What the JaxEngine's device state costs, checked before anything is allocated.

The engine's KV cache is dense: every layer holds keys and values for `max_slots x
max_seq_len` tokens, whatever the admission budget (`kv_budget_tokens`) lets in:

    kv bytes = 2 (k, v) x layers x max_slots x max_seq_len x kv_heads x head_dim x itemsize

`check_fits` compares that plus the weights (in the engine's dtype) with the memory the
engine's devices can still give (`memory_stats()`: `bytes_limit - bytes_in_use`, per device,
state split evenly over the engine mesh; a backend without stats, e.g. CPU, is checked
against the host's available memory) and raises a `ConfigError` naming the keys to change,
so a config that cannot fit fails at start-up instead of running out of memory mid-run.
A `HEADROOM` share of that memory is left for activations and XLA workspace.

The paged layout (`engine.kv_layout='paged'`) allocates a page pool instead, sized by
`kv_budget_tokens` (rounded up to whole pages) or, with `engine.kv_memory_fraction`, from
the free memory itself (`pool_pages_for_memory`: that fraction of what the weights leave);
`check_fits` then checks the pool's bytes (`paged_cache_bytes`), and a config no longer has
to fit `max_slots x max_seq_len`.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from pipelinerl_jax import config_checks as cfg_lib

HEADROOM = 0.1  # of free device memory, left for activations (prefill logits) and XLA
GiB = 1 << 30


def kv_cache_bytes(model_cfg, max_slots: int, max_seq_len: int, dtype) -> int:
    """Bytes of the dense engine cache (`init_engine_cache`'s arrays)."""
    per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
    return int(per_token * max_slots * max_seq_len * np.dtype(dtype).itemsize)


def page_bytes(model_cfg, page_size: int, dtype, layout: Optional[tuple] = None) -> int:
    """Bytes of one page in every layer (keys and values); `layout`: the (kv heads, head_dim)
    the pool stores (`engine_programs.paged_layout`; default the model's)."""
    heads, width = layout or (model_cfg.num_kv_heads, model_cfg.head_dim)
    per_token = 2 * model_cfg.num_layers * heads * width
    return int(per_token * page_size * np.dtype(dtype).itemsize)


def paged_cache_bytes(model_cfg, num_pages: int, page_size: int, dtype,
                      layout: Optional[tuple] = None) -> int:
    """Bytes of the paged engine cache (`init_paged_cache`'s pools)."""
    return num_pages * page_bytes(model_cfg, page_size, dtype, layout)


def pool_pages_for_memory(model_cfg, page_size: int, dtype, fraction: float,
                          devices: Sequence, prefix: str = "engine",
                          available: Optional[int] = None,
                          layout: Optional[tuple] = None) -> int:
    """Pages (of `layout`, `page_bytes`) in `fraction` of the memory the weights leave free
    on `devices` (`available` overrides the measurement); `ConfigError` when it cannot be
    measured or holds no page."""
    free = free_bytes(devices) if available is None else available
    key = f"{prefix}.kv_memory_fraction"
    if free is None:
        raise cfg_lib.ConfigError(key, f"the free memory of {devices[0].platform} devices "
                                       f"cannot be measured; set {prefix}.kv_budget_tokens")
    pages = int(fraction * (free - weight_bytes(model_cfg, dtype))
                // page_bytes(model_cfg, page_size, dtype, layout))
    if pages < 1:
        raise cfg_lib.ConfigError(key, f"{fraction} of the {free / GiB:.2f} GiB free after the "
                                       f"weights holds no page of {page_size} tokens")
    return pages


def weight_bytes(model_cfg, dtype) -> int:
    return int(model_cfg.num_params * np.dtype(dtype).itemsize)


def host_available_bytes() -> Optional[int]:
    """The host's available memory (`MemAvailable`), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_bytes(devices: Sequence) -> Optional[int]:
    """The memory these devices can still allocate together, None where unknown."""
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        return sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    if all(d.platform == "cpu" for d in devices):  # CPU devices share the host's memory
        return host_available_bytes()
    return None


def check_fits(model_cfg, max_slots: int, max_seq_len: int, dtype, devices: Sequence,
               prefix: str = "engine", available: Optional[int] = None,
               pages: Optional[tuple] = None, pool_key: str = "kv_budget_tokens",
               layout: Optional[tuple] = None, weights: Optional[int] = None,
               staged: int = 0) -> dict:
    """Raises `ConfigError` when the dense KV cache (or, with `pages=(num_pages, page_size)`,
    the page pool, sized by key `pool_key`) plus the weights would not fit in
    `(1 - HEADROOM)` of the devices' free memory (`available` overrides the measurement);
    returns the figures otherwise. The weights are everything the engine holds: `weights`
    bytes live (default: the model's in `dtype`; a LoRA engine adds its adapters) plus
    `staged`, the next version's while it waits for a step boundary (a full version's
    weights, or only the adapters)."""
    kv = (kv_cache_bytes(model_cfg, max_slots, max_seq_len, dtype) if pages is None
          else paged_cache_bytes(model_cfg, *pages, dtype, layout))
    live = weight_bytes(model_cfg, dtype) if weights is None else int(weights)
    weights = live + int(staged)
    free = free_bytes(devices) if available is None else available
    out = {"kv_cache_bytes": kv, "weight_bytes": weights, "live_weight_bytes": live,
           "staged_weight_bytes": int(staged), "free_bytes": free}
    if free is None or kv + weights <= (1 - HEADROOM) * free:
        return out
    if pages is not None:
        fit = int(max(0.0, (1 - HEADROOM) * free - weights)
                  // page_bytes(model_cfg, pages[1], dtype, layout))
        raise cfg_lib.ConfigError(
            f"{prefix}.{pool_key}", f"the KV page pool ({pages[0]} pages of {pages[1]} "
            f"tokens, {prefix}.dtype={np.dtype(dtype).name}: {kv / GiB:.2f} GiB) plus the "
            f"weights ({weights / GiB:.2f} GiB) need more than {1 - HEADROOM:.0%} of the "
            f"{free / GiB:.2f} GiB free on {len(devices)} device(s) ({devices[0].platform}); "
            f"at most {fit} pages fit: lower {prefix}.{pool_key}")
    per_slot = kv_cache_bytes(model_cfg, 1, max_seq_len, dtype)
    fit = int(max(0.0, (1 - HEADROOM) * free - weights) // per_slot)
    raise cfg_lib.ConfigError(
        f"{prefix}.max_slots", f"the dense KV cache ({prefix}.max_slots={max_slots} x "
        f"{prefix}.max_seq_len={max_seq_len}, {prefix}.dtype={np.dtype(dtype).name}: "
        f"{kv / GiB:.2f} GiB) plus the weights ({weights / GiB:.2f} GiB) need more than "
        f"{1 - HEADROOM:.0%} of the {free / GiB:.2f} GiB free on {len(devices)} device(s) "
        f"({devices[0].platform}); at this {prefix}.max_seq_len at most {fit} slots fit: "
        f"lower {prefix}.max_slots or {prefix}.max_seq_len, or use a smaller {prefix}.dtype")
