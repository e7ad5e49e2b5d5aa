"""The experiment config: every section in one `ConfigDict`, validated in one place.

`base_config()` assembles the sections each package owns (model, tokenizer, task, env (the
environment's keys when `task.name` is one: `pipelinerl_jax.envs`), one per
engine backend of `rollout/factory.BACKENDS`, loss, transport, ...) plus the pipeline's own
(mode, max_lag, lag_control, learner, rollout, resources, lag_injection); `configs/*.py` start
from it.
`validate(config)` runs before any process starts and raises one `ConfigError` naming the
offending key; `resolve(config)` then fills in the values derived from the user's settings,
once, so every process reads the same ones:

- **context length.** `model.max_seq_len` is the run's context (prompt + completion): the
  learner and the warm start pack rows of it, the queue bounds prompts by it, an episode budget
  defaults to it. Each backend's own context (`engine.max_seq_len`, the JaxEngine's KV cache
  length; `sglang.max_seq_len`, the context the servers were launched with) is None until
  resolved to `model.max_seq_len`; set explicitly it may be smaller (a shorter cache), never
  larger (the learner could not pack what the engine samples).
- **lag limits.** `rollout.admission_lag` (how many versions ahead of the learner a worker may
  start a group; 0 is lock-step: sync mode, and lag injection, which feeds each step the
  weights it prescribes) and `transport.max_lag` (the queue's staleness cut: None under lag
  injection, whose lags are prescribed, else the same limit) come from `lag_limits`.

Config files are Python (ml_collections convention) and therefore trusted code: never load one
you did not write.

The package sections are imported inside the functions that need them: they load JAX (the
engines), and the launcher and every child role import this module before a child has
pinned its cores and set its accelerators.
"""
from __future__ import annotations

import math
import os

import ml_collections
from ml_collections import config_dict

from pipelinerl_jax import resources
from pipelinerl_jax.config_checks import ConfigError, check_keys
from pipelinerl_jax.lag_control import lag_control_config, validate_lag_control

MODES = ("async", "sync")
CONTEXT_KEY = "max_seq_len"  # each backend section's own context; None = model.max_seq_len
INJECTION_KINDS = ("fixed", "uniform", "geometric")


def optimizer_config(**kw) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict(dict(
        learning_rate=1e-4, warmup_steps=0, total_steps=1000, decay="constant",
        final_lr_ratio=0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0))
    c.update(kw)
    return c


def base_config() -> ml_collections.ConfigDict:
    from pipelinerl_jax.envs import env_config  # late: JAX
    from pipelinerl_jax.losses import advantage_config, loss_config  # late: JAX
    from pipelinerl_jax.models.factory import model_config  # late: JAX
    from pipelinerl_jax.models.lora import lora_config  # late: JAX
    from pipelinerl_jax.rollout.factory import BACKENDS  # late: JAX
    from pipelinerl_jax.tasks import task_config  # late: JAX
    from pipelinerl_jax.tokenizer import tokenizer_config  # late: JAX
    from pipelinerl_jax.transport import transport_config  # late: JAX

    c = ml_collections.ConfigDict()
    c.mode = "async"  # 'async' pipeline | 'sync' lock-step baseline
    c.seed = 0
    c.max_lag = 4  # tokens older than this many versions are never trained on (async)
    c.lag_control = lag_control_config()  # enabled: the allowed lag follows a health signal
    c.model = model_config()
    c.lora = lora_config()  # adapters on the model's projections (docs/lora.md)
    c.tokenizer = tokenizer_config()
    c.task = task_config()
    c.env = env_config()  # used when task.name is an environment (multi-turn episodes)
    del c.env["name"]  # task.name picks it
    c.sampler = ml_collections.ConfigDict(dict(
        kind="jax",  # a row of rollout/factory.BACKENDS: 'jax' (embedded) | 'sglang' (HTTP)
        weights_dir="",  # where versions are written for 'sglang'; "" = WORKDIR/weights
        keep_weight_versions=3,
    ))
    for b in BACKENDS.values():  # 'engine' (JaxEngine), 'sglang' (servers), ...
        c[b.section] = b.config()
        c[b.section][CONTEXT_KEY] = config_dict.placeholder(int)  # resolve: model.max_seq_len
    c.sampling = ml_collections.ConfigDict(dict(
        max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=0))
    c.rollout = ml_collections.ConfigDict(dict(
        num_workers=1, group_size=8, advantage=advantage_config(), stats_every_s=1.0,
        admission_lag=config_dict.placeholder(int),  # derived by resolve (lag_limits)
    ))
    c.loss = loss_config()
    c.learner = ml_collections.ConfigDict(dict(
        batch_groups=8,  # prompts (groups) per learner step; rows = batch_groups * group_size
        minibatches=1,  # optimizer steps per batch
        micro_batches=1,  # gradient accumulation within a minibatch
        total_steps=100,
        optimizer=optimizer_config(),
        recompute_proximal="auto",  # 'auto' (losses that use it) | True | False
        eval_every=10, eval_size=128,
        checkpoint_every=10, keep_checkpoints=2,
        max_consecutive_skips=20,
        get_timeout_s=2.0,
        record_batches=False,  # WORKDIR/recorded/: every trained batch, for replay
        # the dtype versions are published in (floating params): 'auto' = the embedded
        # engine's `engine.dtype` when narrower than `model.param_dtype` (what the engine
        # casts to anyway), else as trained | 'float32' | 'bfloat16' | 'float16'
        publish_dtype="auto",
    ))
    c.warm_start = ml_collections.ConfigDict(dict(
        steps=0,  # supervised steps on the task's demonstrations before RL (0 = none)
        batch_size=64, micro_batches=1, log_every=20,
        optimizer=optimizer_config(learning_rate=3e-3, warmup_steps=50, decay="cosine"),
        checkpoint=config_dict.placeholder(str),  # reuse an existing warm-start checkpoint
        # > 0: stop at the first held-out evaluation (every `eval_every` steps, on the
        # learner's eval set) whose accuracy reaches this; `steps` is then the most it trains.
        # 0: train exactly `steps`.
        target_accuracy=0.0, eval_every=10,
    ))
    c.mesh = ml_collections.ConfigDict(dict(shape=(1, 1, 1)))
    c.transport = transport_config()
    c.transport.queue_port = 0  # 0 = the launcher picks free ports
    c.transport.weights_port = 0
    c.transport.capacity_rollouts = 16384
    c.lag_injection = ml_collections.ConfigDict(dict(
        enabled=False, kind="fixed", k=0, max_k=8, seed=0))
    c.resources = resources.resources_config()  # cores and accelerators per role
    c.launch = ml_collections.ConfigDict(dict(
        max_worker_restarts=3, startup_timeout_s=300.0, shutdown_timeout_s=20.0,
        max_queue_restarts=3,  # a restarted queue is empty: workers regenerate what it lost
        max_learner_restarts=0,  # >0: restart in place, resume from the last checkpoint
        # learner processes (jax.distributed) started on this host, each with an equal share
        # of the mesh's devices; on real hosts, one per host (docs/multihost.md)
        learner_processes=1,
    ))
    return c


def parse_cores(spec: str, key: str) -> list:
    """'0,2-3' -> [0, 2, 3]; '' -> []."""
    return resources.parse_indices(spec, key)


def _int(cfg, key, lo=0):
    node = cfg
    for part in key.split("."):
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, int) or node < lo:
        raise ConfigError(key, f"must be an integer >= {lo}, got {node!r}")
    return node


def context_length(cfg, section: str = "") -> int:
    """The context of backend section `section` ('' = the run's: `model.max_seq_len`): its
    own `max_seq_len` when set, else the model's. `resolve` stores it; this is the one
    definition."""
    own = cfg[section][CONTEXT_KEY] if section else None
    return int(cfg.model.max_seq_len if own is None else own)


def sampler_context(cfg) -> int:
    """The context of the backend that samples (`sampler.kind`)."""
    from pipelinerl_jax.rollout.factory import backend  # late: JAX
    return context_length(cfg, backend(cfg.sampler.kind).section)


def _context_key(cfg) -> str:
    """The key that sets the sampler's context, for error messages."""
    from pipelinerl_jax.rollout.factory import backend  # late: JAX
    section = backend(cfg.sampler.kind).section
    return f"{section}.{CONTEXT_KEY}" if cfg[section][CONTEXT_KEY] is not None \
        else "model.max_seq_len"


def lag_limits(cfg):
    """(admission lag, queue max_lag) of a run config (module docstring): sync and lag
    injection admit lock-step (0); the queue drops by staleness except under injection."""
    if cfg.lag_injection.enabled:
        return 0, None  # the lag is prescribed; nothing is stale by accident
    limit = 0 if cfg.mode == "sync" else int(cfg.max_lag)
    return limit, limit


PUBLISH_DTYPES = ("auto", "float32", "bfloat16", "float16")


def publish_dtype(cfg):
    """The dtype the learner publishes versions in (`learner.publish_dtype`), or None to
    publish them as trained. 'auto': the embedded engine's `engine.dtype` when it is narrower
    than `model.param_dtype` (a float32 learner feeding a bf16 engine sends bf16: half the
    bytes, the same weights served), else None; an SGLang sampler loads what it is sent in
    its own dtype, so 'auto' leaves it alone. Lag injection keeps its history of versions in
    the learner's dtype (its checkpoint restores it like the params), so it publishes as
    trained."""
    import jax.numpy as jnp  # late: JAX
    from pipelinerl_jax.models.decoder_config import dtype_of
    want = cfg.learner.publish_dtype
    if want not in PUBLISH_DTYPES:
        raise ConfigError("learner.publish_dtype", f"must be one of {PUBLISH_DTYPES}, "
                                                   f"got {want!r}")
    trained = jnp.dtype(dtype_of(cfg.model.param_dtype))
    if want == "auto":
        if cfg.sampler.kind != "jax" or cfg.lag_injection.enabled:
            return None
        engine = jnp.dtype(dtype_of(cfg.engine.dtype))
        return engine if engine.itemsize < trained.itemsize else None
    if cfg.lag_injection.enabled:
        raise ConfigError("learner.publish_dtype", f"{want!r} with lag_injection.enabled: the "
                          "injector keeps and checkpoints versions in the learner's dtype; "
                          "leave it 'auto'")
    target = jnp.dtype(dtype_of(want))
    return None if target == trained else target


def completion_tokens(cfg) -> int:
    """The longest completion a rollout may have (the learner's and the queue's bound):
    `sampling.max_new_tokens`, or for an environment the episode token budget
    (`env.max_episode_tokens`, 0 = the sampler's context), prompt included."""
    from pipelinerl_jax.envs import is_env_task  # late: JAX
    if is_env_task(cfg):
        return int(cfg.env.max_episode_tokens or sampler_context(cfg))
    return int(cfg.sampling.max_new_tokens)


def _validate_episode_budget(cfg, task, tok, context_key: str) -> None:
    """An environment's limits against the sampler's context, set by `context_key` (errors
    name the key)."""
    budget_key = "env.max_episode_tokens" if cfg.env.max_episode_tokens else context_key
    budget = completion_tokens(cfg)
    if budget > sampler_context(cfg):
        raise ConfigError("env.max_episode_tokens", f"{budget} exceeds the context "
                          f"{context_key}={sampler_context(cfg)}")
    try:
        task.stop_token_ids(tok)
    except ValueError as e:
        raise ConfigError("task.name", str(e)) from None
    if cfg.tokenizer.kind == "char":  # sizes in characters are exact
        need = task.max_prompt_chars + 1 + task.max_completion_tokens
        if need > budget:
            raise ConfigError(budget_key, f"{budget} cannot hold the longest correct episode "
                              f"of {cfg.task.name!r} ({need} tokens with its prompt)")


def validate_context(cfg) -> None:
    """`model.max_seq_len` against the checkpoint, and every backend's own context against
    it (errors name the key)."""
    from pipelinerl_jax.models.hf_io import load_config  # late: JAX
    from pipelinerl_jax.rollout.factory import BACKENDS  # late: JAX
    n = _int(cfg, "model.max_seq_len", 2)
    if cfg.model.init == "hf":
        positions = load_config(cfg.model.path).max_position_embeddings
        if n > positions:
            raise ConfigError("model.max_seq_len", f"{n} exceeds the checkpoint's "
                              f"max_position_embeddings={positions} ({cfg.model.path})")
    for b in BACKENDS.values():
        own = cfg[b.section][CONTEXT_KEY]
        if own is None:
            continue
        key = f"{b.section}.{CONTEXT_KEY}"
        _int(cfg, key, 2)
        if own > n:
            raise ConfigError(key, f"{own} exceeds the run's context model.max_seq_len={n} "
                              f"(the learner packs rows of model.max_seq_len; set the context "
                              f"there, and {key} follows it unless set)")


def with_contexts(cfg) -> ml_collections.ConfigDict:
    """A copy of `cfg` with every backend section's context filled in (`context_length`)."""
    from pipelinerl_jax.rollout.factory import BACKENDS  # late: JAX
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    for b in BACKENDS.values():
        cfg[b.section][CONTEXT_KEY] = context_length(cfg, b.section)
    return cfg


def _validate_lora_run(cfg) -> None:
    """What a LoRA run needs of the rest of the config (docs/lora.md: what is built)."""
    if not cfg.lora.enabled:
        return
    if cfg.sampler.kind not in ("jax", "sglang"):
        raise ConfigError("lora.enabled", f"adapter-only publication reaches the embedded "
                          f"JaxEngine (sampler.kind='jax') and SGLang servers launched with "
                          f"--enable-lora (sampler.kind='sglang'), not "
                          f"sampler.kind={cfg.sampler.kind!r}")
    # sglang-jax servers (sampler.kind='sglang' too) have no /load_lora_adapter: the engine
    # refuses them at start-up, naming the server (sglang_client.LORA_HINT).


def validate_learner_batch(cfg) -> tuple:
    """`mesh.shape` and the learner's batch split (rows over minibatches, micro-batches and
    the mesh's batch axes); returns the mesh shape."""
    L, r = cfg.learner, cfg.rollout
    for key in ("batch_groups", "minibatches", "micro_batches"):
        _int(cfg, f"learner.{key}", 1)
    _int(cfg, "rollout.group_size", 1)
    shape = tuple(cfg.mesh.shape)
    if len(shape) != 3 or any(not isinstance(x, int) or x < 1 for x in shape):
        raise ConfigError("mesh.shape", f"must be three positive sizes (data, fsdp, tensor), "
                                        f"got {shape}")
    rows = L.batch_groups * r.group_size
    split = L.minibatches * L.micro_batches * shape[0] * shape[1]
    if rows % split:
        raise ConfigError("learner.batch_groups", f"a batch of {L.batch_groups} groups x "
                          f"{r.group_size} samples = {rows} rows is not divisible by "
                          f"minibatches x micro_batches x mesh data*fsdp = {split}")
    return shape


def validate(cfg) -> None:
    """Checks the whole experiment config; raises `ConfigError` naming the first bad key."""
    from pipelinerl_jax.envs import build_task, is_env_task  # late: JAX
    from pipelinerl_jax.losses import (  # late: JAX
        validate_advantage_config, validate_loss_config)
    from pipelinerl_jax.models.factory import validate_model_config  # late: JAX
    from pipelinerl_jax.models.lora import validate_lora_config  # late: JAX
    from pipelinerl_jax.rollout.factory import BACKENDS  # late: JAX
    from pipelinerl_jax.tokenizer import get_tokenizer  # late: JAX
    from pipelinerl_jax.transport import validate_transport_config  # late: JAX

    check_keys(cfg, "", base_config().keys())
    if cfg.mode not in MODES:
        raise ConfigError("mode", f"must be one of {MODES}, got {cfg.mode!r}")
    _int(cfg, "seed")
    _int(cfg, "max_lag")
    derived = lag_limits(cfg)[0]
    if cfg.rollout.admission_lag not in (None, derived):  # None until resolve sets it
        raise ConfigError("rollout.admission_lag", f"is derived from mode, max_lag and "
                          f"lag_injection (here {derived}); set max_lag instead")
    check_keys(cfg.lag_control, "lag_control", lag_control_config().keys())
    validate_lag_control(cfg)
    validate_model_config(cfg.model, "model")
    validate_lora_config(cfg.lora, "lora")
    _validate_lora_run(cfg)
    tok = get_tokenizer(cfg.tokenizer)
    task = build_task(cfg)
    if cfg.sampler.kind not in BACKENDS:
        raise ConfigError("sampler.kind", f"must be one of {tuple(BACKENDS)}, "
                                          f"got {cfg.sampler.kind!r}")
    validate_context(cfg)
    context_key = _context_key(cfg)  # before the copy below fills the sections in
    cfg = with_contexts(cfg)  # the sections' checks see the contexts the run will use
    _int(cfg, "sampler.keep_weight_versions", 1)
    _int(cfg, "rollout.num_workers", 1)
    for kind, b in BACKENDS.items():  # every section, so a switch of kind finds no surprise
        b.validate(cfg, selected=kind == cfg.sampler.kind)
    validate_loss_config(cfg.loss)
    validate_advantage_config(cfg.rollout.advantage, completion_tokens(cfg))
    validate_transport_config(cfg.transport, "transport")

    s = cfg.sampling
    _int(cfg, "sampling.max_new_tokens", 1)
    if not isinstance(s.temperature, (int, float)) or s.temperature < 0:
        raise ConfigError("sampling.temperature", f"must be >= 0, got {s.temperature!r}")
    if not 0 < s.top_p <= 1:
        raise ConfigError("sampling.top_p", f"must be in (0, 1], got {s.top_p!r}")
    _int(cfg, "sampling.top_k")
    prompt_tokens = task.max_prompt_chars + 1 if cfg.tokenizer.kind == "char" else None
    if is_env_task(cfg):
        _validate_episode_budget(cfg, task, tok, context_key)
    elif prompt_tokens and prompt_tokens + s.max_new_tokens > sampler_context(cfg):
        raise ConfigError(context_key, f"{sampler_context(cfg)} cannot hold the "
                          f"task's longest prompt ({prompt_tokens} tokens) plus "
                          f"sampling.max_new_tokens={s.max_new_tokens}")

    r, L = cfg.rollout, cfg.learner
    _int(cfg, "rollout.num_workers", 1)
    _int(cfg, "rollout.group_size", 1)
    for key in ("batch_groups", "minibatches", "micro_batches", "total_steps",
                "eval_size", "checkpoint_every", "keep_checkpoints", "max_consecutive_skips"):
        _int(cfg, f"learner.{key}", 1)
    _int(cfg, "learner.eval_every")
    if L.recompute_proximal not in ("auto", True, False):
        raise ConfigError("learner.recompute_proximal", "must be 'auto', True or False")
    publish_dtype(cfg)  # validates learner.publish_dtype
    if not isinstance(L.record_batches, bool):
        raise ConfigError("learner.record_batches", f"must be True or False, "
                                                    f"got {L.record_batches!r}")
    shape = validate_learner_batch(cfg)
    rows = L.batch_groups * r.group_size
    for key in ("learning_rate", "max_grad_norm"):
        v = L.optimizer[key]
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"learner.optimizer.{key}", f"must be a positive number, got {v!r}")

    # The queue holds every rollout until the checkpoint covering its step is durable; too
    # small a capacity would stall producers (and so the learner) between checkpoints.
    held = rows * (2 * L.checkpoint_every + cfg.max_lag + 2)
    if cfg.transport.capacity_rollouts < held:
        raise ConfigError("transport.capacity_rollouts", f"{cfg.transport.capacity_rollouts} "
                          f"cannot hold the {held} rollouts that may await a durable checkpoint "
                          f"(batch {rows} x (2 x learner.checkpoint_every {L.checkpoint_every} "
                          f"+ max_lag {cfg.max_lag} + 2)); raise it or checkpoint more often")

    inj = cfg.lag_injection
    if inj.enabled:
        if inj.kind not in INJECTION_KINDS:
            raise ConfigError("lag_injection.kind", f"must be one of {INJECTION_KINDS}")
        _int(cfg, "lag_injection.k")
        _int(cfg, "lag_injection.max_k")
        if inj.max_k < inj.k:
            raise ConfigError("lag_injection.max_k", f"must be >= lag_injection.k={inj.k}")
    if cfg.warm_start.steps:
        _int(cfg, "warm_start.steps")
        _int(cfg, "warm_start.batch_size", 1)
    target = cfg.warm_start.get("target_accuracy", 0.0)
    if isinstance(target, bool) or not isinstance(target, (int, float)) \
            or not 0.0 <= target <= 1.0:
        raise ConfigError("warm_start.target_accuracy", "must be a held-out accuracy in "
                          f"[0, 1] (0: train exactly warm_start.steps), got {target!r}")
    if target:
        _int(cfg, "warm_start.eval_every", 1)  # (on the learner's held-out set)
    for key in ("max_worker_restarts", "max_queue_restarts", "max_learner_restarts"):
        _int(cfg, f"launch.{key}")
    check_keys(cfg.resources, "resources", resources.resources_config().keys())
    resources.validate_resources(cfg.resources, num_workers=r.num_workers,
                                 sampler_kind=cfg.sampler.kind, mesh_size=math.prod(shape),
                                 environ=os.environ)
    procs = _int(cfg, "launch.learner_processes", 1)
    if math.prod(shape) % procs:
        raise ConfigError("launch.learner_processes", f"{procs} processes cannot share the "
                          f"{math.prod(shape)} devices of mesh.shape={shape} equally")
    if tok.vocab_size <= 0:
        raise ConfigError("tokenizer", "tokenizer has an empty vocabulary")


def resolve(cfg) -> ml_collections.ConfigDict:
    """Derived values filled in once, after validation (module docstring): the backends'
    contexts, the lag limits, and the transport section's bounds."""
    from pipelinerl_jax.tokenizer import get_tokenizer  # late: JAX
    cfg = with_contexts(cfg)
    tok = get_tokenizer(cfg.tokenizer)
    cfg.transport.vocab_size = tok.vocab_size
    cfg.rollout.admission_lag, cfg.transport.max_lag = lag_limits(cfg)
    cfg.transport.max_completion_tokens = completion_tokens(cfg)
    cfg.transport.max_prompt_tokens = context_length(cfg)
    return cfg
