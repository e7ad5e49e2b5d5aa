"""The simulator's config: defaults, validation (one place, before anything runs), setup.

`default_config()` lists every key; config files in `configs/sim/` start from it. Units in
the config are the ones people quote: GB, GB/s, TFLOP/s, billions of parameters, seconds.
A hardware or model field left at None takes the preset's value (`sim/hardware.py`).

`build_setup(cfg)` validates and returns a `SimSetup`; every problem is a
`pipelinerl_jax.config_checks.ConfigError` naming the key, raised before any simulation.
"""
from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np
from ml_collections import config_dict

from pipelinerl_jax.config_checks import ConfigError, check_keys, number, one_of, positive_int
from pipelinerl_jax.sim import compiled
from pipelinerl_jax.sim.hardware import ACCELERATORS, MODELS, Accelerator, ModelSpec
from pipelinerl_jax.sim.latency import DecodeLatency, TrainTime, kv_capacity_tokens
from pipelinerl_jax.sim.lengths import Empirical, LogNormal, lengths_from_run
from pipelinerl_jax.sim.paged import paged_concurrency
from pipelinerl_jax.sim.pipeline import MODES, SimSetup
from pipelinerl_jax.sim.turns import Workload



def _F():  # an optional float; each field needs its own placeholder (they are references)
    return config_dict.placeholder(float)


def _I():
    return config_dict.placeholder(int)


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "async"  # sync | one_step | async | sweep
    c.seed = 0
    c.steps = 200  # learner steps to simulate
    c.warmup_steps = _I()  # steps left out of steady-state figures; None: steps // 10
    c.devices = 8
    c.split = ml_collections.ConfigDict({"samplers": 6, "trainers": 2})
    c.hardware = ml_collections.ConfigDict({
        "preset": "h100", "hbm_gb": _F(), "hbm_bw_gbs": _F(), "peak_tflops": _F(),
        "mfu": _F(), "mbu": _F(), "train_mfu": _F(), "hbm_util": _F()})
    c.model = ml_collections.ConfigDict({
        "preset": "qwen2.5-7b", "params_b": _F(), "layers": _I(), "heads": _I(), "kv_heads": _I(),
        "head_dim": _I(), "weight_bytes": _F(), "kv_bytes": _F()})
    c.latency = ml_collections.ConfigDict({"sharpness": 4.0, "step_overhead_s": 0.0})
    c.lengths = ml_collections.ConfigDict({
        "kind": "lognormal",  # lognormal | empirical
        "median": 1000.0, "tail": 6000.0, "tail_quantile": 0.99,  # lognormal
        "truncated_fraction": 0.0,  # share of samples that run to rollout.max_new_tokens
        "observed": (), "path": ""})  # empirical: a list, or a run dir / samples.jsonl
    c.rollout = ml_collections.ConfigDict({
        "concurrency": 256,  # max running sequences per engine
        "max_new_tokens": 8192, "prompt_len": 256, "devices_per_engine": 1,
        # KV reserved per sequence: 'max_length' = prompt + max_new_tokens (static slots);
        # 'expected' = the mean cached length of a running sequence under continuous
        # batching, prompt + E[L²]/(2E[L]) (length-biased, renewal theory); 'paged' = the
        # mean active sequences of JaxEngine's paged layout: pages held for the next decode
        # chunk of steps_per_sync tokens, in whole chunks (sim/paged.py, docs/sim.md).
        "kv_budget": "expected", "prefix_sharing": True,
        # kv_budget='paged' only (engine.page_size / steps_per_sync / refill_threshold;
        # refill_threshold 0 = the engine's auto, max(1, concurrency // 8))
        "page_size": 16, "steps_per_sync": 16, "refill_threshold": 0})
    c.train = ml_collections.ConfigDict({
        "batch_size": 64, "group_size": 16,  # prompts per step × samples per prompt
        "flops_per_param_token": 6.0, "step_overhead_s": 0.0,
        "state_bytes_per_param": 16.0})  # params + grads + Adam; 0 disables the check
    # Multi-turn episodes (sim/turns.py): turns per episode and tool latency (s) between
    # turns, each a tuple of values drawn uniformly, e.g. (4,) or (1, 2, 8); `lengths` is
    # per turn; env_tokens are appended after each turn but the last (every turn prefills
    # the whole episode so far).
    c.workload = ml_collections.ConfigDict({"turns": (1,), "tool_latency": (0.0,), "env_tokens": 0})
    c.queue = ml_collections.ConfigDict({"capacity_batches": _I()})  # None: unbounded
    c.max_lag = _I()  # None: no staleness limit
    c.weight_sync_s = 5.0
    c.pause_samplers_on_sync = True
    c.sweep = ml_collections.ConfigDict({"max_staleness": 8, "steps": 100, "trainers": ()})
    c.output = ml_collections.ConfigDict({"series_dt_s": 1.0, "trace_steps": 20, "plots": True})
    c.calibrate_from = ""
    # a compile check's JSON (experiments/compile_check.py --out): decode and train step
    # costs from the TPU compiler instead of the datasheet roofline (sim/compiled.py)
    c.costs_from = ""
    return c


_TOP = ("mode", "seed", "steps", "warmup_steps", "devices", "split", "hardware", "model",
        "latency", "lengths", "rollout", "train", "workload", "queue", "max_lag", "weight_sync_s",
        "pause_samplers_on_sync", "sweep", "output", "calibrate_from", "costs_from")


def _check_sections(cfg):
    check_keys(cfg, "", _TOP)
    ref = default_config()
    for sec in _TOP:
        if sec in cfg and isinstance(ref[sec], ml_collections.ConfigDict):
            check_keys(cfg[sec], sec, ref[sec].keys())


def accelerator(cfg) -> Accelerator:
    preset = one_of(cfg, "hardware.preset", ACCELERATORS)
    acc = ACCELERATORS[preset]
    h = cfg.hardware
    scale = {"hbm_gb": ("hbm_bytes", 1e9), "hbm_bw_gbs": ("hbm_bw", 1e9),
             "peak_tflops": ("peak_flops", 1e12)}
    repl = {}
    for key, (field, unit) in scale.items():
        if h[key] is not None:
            repl[field] = number(cfg, f"hardware.{key}", lo=0, lo_open=True) * unit
    for key in ("mfu", "mbu", "train_mfu", "hbm_util"):
        if h[key] is not None:
            repl[key] = number(cfg, f"hardware.{key}", lo=0, hi=1, lo_open=True)
    return dataclasses.replace(acc, **repl)


def model_spec(cfg) -> ModelSpec:
    preset = one_of(cfg, "model.preset", MODELS)
    m = cfg.model
    repl = {}
    if m.params_b is not None:
        repl["params"] = number(cfg, "model.params_b", lo=0, lo_open=True) * 1e9
    for key in ("layers", "heads", "kv_heads", "head_dim"):
        if m[key] is not None:
            repl[key] = positive_int(cfg, f"model.{key}")
    for key in ("weight_bytes", "kv_bytes"):
        if m[key] is not None:
            repl[key] = number(cfg, f"model.{key}", lo=0, lo_open=True)
    return dataclasses.replace(MODELS[preset], **repl)


def length_distribution(cfg):
    max_len = positive_int(cfg, "rollout.max_new_tokens")
    kind = one_of(cfg, "lengths.kind", ("lognormal", "empirical"))
    trunc = number(cfg, "lengths.truncated_fraction", lo=0.0, hi=1.0)
    if kind == "lognormal":
        med = number(cfg, "lengths.median", lo=0, lo_open=True)
        tail = number(cfg, "lengths.tail", lo=med, lo_open=True)
        q = number(cfg, "lengths.tail_quantile", lo=0.5, hi=1.0, lo_open=True)
        if q >= 1.0:
            raise ConfigError("lengths.tail_quantile", f"must be < 1, got {q}")
        return LogNormal(med, tail, q, max_len, trunc)
    values = list(cfg.lengths.observed)
    if cfg.lengths.path:
        try:
            values = list(lengths_from_run(cfg.lengths.path))
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError("lengths.path", f"cannot read response lengths: {e}") from None
    if not values:
        raise ConfigError("lengths.observed", "empirical lengths need lengths.observed or lengths.path")
    try:
        return Empirical(values, max_len, trunc)
    except ValueError as e:
        raise ConfigError("lengths.observed", str(e)) from None


def _values(cfg, key, cast, lo):
    """A number or a non-empty tuple of numbers >= lo, as a tuple."""
    v = cfg.workload[key]
    vals = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    try:
        out = tuple(cast(x) for x in vals)
    except (TypeError, ValueError):
        raise ConfigError(f"workload.{key}", f"must be a number or a tuple of numbers, got {v!r}") from None
    if not out or any(not math.isfinite(x) or x < lo or x != x for x in out) or \
            any(cast is int and x != float(y) for x, y in zip(out, vals)):
        raise ConfigError(f"workload.{key}", f"needs values >= {lo}, got {v!r}")
    return out


def workload(cfg) -> Workload:
    return Workload(turns=_values(cfg, "turns", int, 1),
                    tool_latency=_values(cfg, "tool_latency", float, 0.0),
                    env_tokens=positive_int(cfg, "workload.env_tokens", allow_zero=True))


def slots_per_engine(cfg, acc, model, lengths, tp, work=None) -> tuple[int, float]:
    """(concurrent sequences per engine, KV capacity in tokens); validates that one fits.
    Multi-turn: a turn holds the episode so far (the longest: every earlier turn at max)."""
    work = work or Workload()
    turns = max(work.turns)
    prompt = positive_int(cfg, "rollout.prompt_len", allow_zero=True)
    cap = kv_capacity_tokens(acc, model, tp)
    longest = prompt + turns * lengths.max_len + (turns - 1) * work.env_tokens
    if cap < longest:
        free_gb = (tp * acc.hbm_bytes * acc.hbm_util - model.weights_total_bytes) / 1e9
        raise ConfigError(
            "rollout.max_new_tokens",
            f"one sequence of prompt_len + max_new_tokens = {longest} tokens needs "
            f"{longest * model.kv_bytes_per_token / 1e9:.3g} GB of KV cache but an engine of "
            f"{tp} x {acc.name} has {free_gb:.3g} GB left after {model.name}'s weights "
            f"(room for {max(cap, 0):.0f} tokens); lower it or raise "
            f"rollout.devices_per_engine / hardware.hbm_gb")
    budget = one_of(cfg, "rollout.kv_budget", ("max_length", "expected", "paged"))
    page_size = positive_int(cfg, "rollout.page_size")
    steps_per_sync = positive_int(cfg, "rollout.steps_per_sync")
    refill = positive_int(cfg, "rollout.refill_threshold", allow_zero=True)
    conc = positive_int(cfg, "rollout.concurrency")
    if budget == "max_length":
        per_seq = longest
    else:
        m1, m2 = lengths.moments()
        # Plus, multi-turn, the earlier turns a turn holds on average.
        before = (work.mean_turns - 1) / 2 * (m1 + work.env_tokens)
        if budget == "paged":
            steps = lengths.sample(np.random.default_rng(12345), 20_000)
            active = paged_concurrency(cap, prompt + before, steps, page_size=page_size,
                                       steps_per_sync=steps_per_sync,
                                       refill_threshold=refill or max(1, conc // 8),
                                       max_slots=conc)
            return max(1, int(active)), cap
        per_seq = prompt + before + m2 / (2 * m1)
    return max(1, min(conc, int(cap // per_seq))), cap


def trainer_fits(cfg, acc, model, trainers) -> bool:
    need = model.params * number(cfg, "train.state_bytes_per_param", lo=0)
    return need <= trainers * acc.hbm_bytes


def build_setup(cfg, mode: str | None = None) -> SimSetup:
    """Validates `cfg` and returns the `SimSetup` for `mode` (default: cfg.mode)."""
    _check_sections(cfg)
    mode = mode or one_of(cfg, "mode", MODES + ("sweep",))
    if mode == "sweep":
        mode = "async"
    steps = positive_int(cfg, "steps")
    devices = positive_int(cfg, "devices")
    tp = positive_int(cfg, "rollout.devices_per_engine")
    samplers = positive_int(cfg, "split.samplers")
    trainers = positive_int(cfg, "split.trainers")
    if mode != "sync":
        if samplers + trainers > devices:
            raise ConfigError("split.samplers", f"split.samplers + split.trainers = "
                              f"{samplers + trainers} exceeds devices = {devices}")
        if samplers % tp:
            raise ConfigError("split.samplers", f"{samplers} is not a multiple of "
                              f"rollout.devices_per_engine = {tp}")
    elif devices % tp:
        raise ConfigError("devices", f"{devices} is not a multiple of rollout.devices_per_engine = {tp}")
    acc, model = accelerator(cfg), model_spec(cfg)
    lengths = length_distribution(cfg)
    work = workload(cfg)
    slots, cap = slots_per_engine(cfg, acc, model, lengths, tp, work)
    learners = devices if mode == "sync" else trainers
    if not trainer_fits(cfg, acc, model, learners):
        key = "devices" if mode == "sync" else "split.trainers"
        raise ConfigError(key, f"{learners} x {acc.name} ({learners * acc.hbm_bytes / 1e9:.0f} GB) "
                               f"cannot hold {model.name}'s training state "
                               f"({model.params * cfg.train.state_bytes_per_param / 1e9:.0f} GB at "
                               f"train.state_bytes_per_param = {cfg.train.state_bytes_per_param})")
    sharp = number(cfg, "latency.sharpness", lo=1.0) if not math.isinf(cfg.latency.sharpness) \
        else math.inf
    overhead = number(cfg, "latency.step_overhead_s", lo=0)
    train_fixed = number(cfg, "train.step_overhead_s", lo=0)
    if cfg.costs_from:
        costs = compiled.read_costs(cfg.costs_from)
        if costs["engine_chips"] != tp:
            raise ConfigError("rollout.devices_per_engine", f"{tp}, but the compile check's "
                              f"engine ({cfg.costs_from}) has {costs['engine_chips']} chips")
        decode = compiled.decode_latency(costs, acc, sharp, overhead)
        train = compiled.train_time(costs, acc, train_fixed)
    else:
        decode = DecodeLatency.roofline(acc, model, tp, sharp, overhead)
        train = TrainTime.roofline(acc, model, number(cfg, "train.flops_per_param_token", lo=0,
                                                      lo_open=True), train_fixed)
    cap_b = cfg.queue.capacity_batches
    if cap_b is not None:
        cap_b = positive_int(cfg, "queue.capacity_batches")
    max_lag = cfg.max_lag
    if max_lag is not None:
        max_lag = positive_int(cfg, "max_lag", allow_zero=True)
    warm = cfg.warmup_steps
    warm = steps // 10 if warm is None else positive_int(cfg, "warmup_steps", allow_zero=True)
    if not isinstance(cfg.pause_samplers_on_sync, bool):
        raise ConfigError("pause_samplers_on_sync", f"must be a bool, got {cfg.pause_samplers_on_sync!r}")
    return SimSetup(
        mode=mode, steps=steps, seed=positive_int(cfg, "seed", allow_zero=True), devices=devices,
        samplers=samplers, trainers=trainers, tp=tp, slots=slots, decode=decode, train=train,
        lengths=lengths, prompt_len=cfg.rollout.prompt_len,
        group_size=positive_int(cfg, "train.group_size"),
        batch_size=positive_int(cfg, "train.batch_size"),
        queue_capacity_batches=math.inf if cap_b is None else cap_b,
        max_lag=max_lag if mode == "async" else None,
        weight_sync_s=number(cfg, "weight_sync_s", lo=0),
        pause_samplers_on_sync=cfg.pause_samplers_on_sync,
        prefix_sharing=bool(cfg.rollout.prefix_sharing),
        warmup_steps=min(warm, steps - 1),
        series_dt_s=number(cfg, "output.series_dt_s", lo=0, lo_open=True),
        trace_steps=positive_int(cfg, "output.trace_steps", allow_zero=True),
        kv_capacity_tokens=cap, workload=work if work.multi_turn else None)
