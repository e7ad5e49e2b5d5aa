"""The learner's train state, optimizer and jitted, sharded train step.

The step is a pure function `(state, batch, hparams) -> (state, metrics)`, jitted once per
sequence bucket with explicit in/out shardings over the mesh and the state donated (big_vision
style). `hparams` holds the numeric hyperparameters of the optimizer (learning rate and its
schedule, Adam's betas, ...) and of the loss (clip ranges, caps, kl_coef) as float32 scalars:
traced, so a sweep over them reuses one compiled step (in-process and in XLA's persistent
cache) instead of compiling one per value.
Inside one step:

  1. optional proximal log-probs: with `minibatches == 1` the proximal policy *is* the
     current one, so `logp_proximal = stop_gradient(logp)` of the same forward (free); with
     several minibatches one no-grad forward over the whole batch fixes it before the first
     update (AReaL's decoupled PPO);
  2. for each minibatch, gradients accumulated over micro-batches (`lax.scan`), then one
     optax update (AdamW, warmup + decay, global-norm clipping), multiplied by the loss's
     `step_scale` metric when the loss declares one (`loss_fn.scales_step`, e.g. VCPO);
     With VCPO's off-policy optimal baseline (`loss_fn.baseline`), each minibatch first
     takes every sequence's own gradient norm (a forward and one backward per sequence, per
     micro-batch) and subtracts its group's baseline from the advantages (losses/vcpo.py);
  3. a non-finite loss or gradient skips that update (params and optimizer state unchanged)
     and is counted in `metrics["skipped"]`.

Micro-batch gradients are weighted by their share of trained tokens for `token_mean`
aggregation (exact), equally otherwise (exact for row-mean aggregations with equal rows).
Sequences are packed (see `batching`): the model runs on dense packed rows and the loss
sees one sequence per row through a gather, so padding costs almost nothing.

Precision (`model.param_dtype`, `model.dtype`). The master weights are `state.params`, in
`param_dtype`; there is no second copy. Whatever that dtype, the optimizer works in float32:
micro-batch gradients (bf16 when the params are) are accumulated in float32, clipped and fed
to AdamW as float32, whose moments are float32 (8 bytes a parameter), and each update is
added to the float32 value of the parameter and rounded once to `param_dtype`.
`param_dtype='float32'` with `dtype='bfloat16'` is the usual mixed precision (float32 master
weights, bf16 matmuls; 4 + 8 bytes a parameter). `param_dtype='bfloat16'` saves 2 of those
bytes and the per-step casts, but bf16 keeps 8 significant bits: an update below about
2^-9 of a weight's magnitude rounds away (Adam moves each weight by about the learning rate,
so lr=1e-6 barely moves weights of magnitude 1e-2). With params below float32 the step
reports `update_rounded_away`, the fraction of parameters whose non-zero update was lost.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from pipelinerl_jax import sharding as sharding_lib
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.learner.batching import PACKED_KEYS, SEQ_KEYS


class TrainState(NamedTuple):
    params: Any  # pure dict of parameter arrays (nnx.to_pure_dict layout)
    opt_state: Any
    step: jax.Array  # int32 optimizer steps applied


class LoRATrainState(NamedTuple):
    """The state of a model with LoRA adapters (models/lora.py): `params` holds only the
    adapters, the only weights with gradients and optimizer state; `frozen` the base weights,
    passed through every step unchanged. (A type of its own, so a full fine-tuning state and
    its checkpoints keep their three fields.)"""
    params: Any
    opt_state: Any
    step: jax.Array
    frozen: Any


def frozen_params(state):
    """The frozen base of a `LoRATrainState`; None for a `TrainState`."""
    return getattr(state, "frozen", None)


def checkpointed(state) -> TrainState:
    """What a checkpoint holds of `state`: all of a `TrainState`; of a `LoRATrainState` the
    adapters, their optimizer state and the step, never the frozen base (the run's init
    checkpoint, which every restart loads again)."""
    return TrainState(state.params, state.opt_state, state.step)


def restored(state, saved: TrainState):
    """`state` with a checkpoint's `saved` (from `checkpointed`) in place: its frozen base,
    if any, is kept as it is."""
    return state._replace(params=saved.params, opt_state=saved.opt_state, step=saved.step)


# The optimizer's numeric hyperparameters: traced inputs of the step, never compile-time
# constants, so runs that differ only in them share one compiled step (and one entry of the
# persistent XLA cache). INJECTED go into `optax.inject_hyperparams`' state (the learning
# rate as the schedule's value); `warmup_steps` / `decay_steps` count optimizer updates.
INJECTED = ("learning_rate", "b1", "b2", "eps", "weight_decay", "max_grad_norm")
OPTIMIZER_HPARAMS = INJECTED + ("warmup_steps", "decay_steps", "final_lr_ratio")
DECAYS = ("cosine", "linear", "constant")


def learning_rate(count, hp, decay: str):
    """The learning rate of update `count` (0-based) from traced `hp`: linear warmup from
    lr / warmup_steps to lr, then `decay` over `decay_steps` to lr · final_lr_ratio
    (cosine or linear) or none. The arithmetic of optax's `join_schedules(linear_schedule,
    cosine_decay_schedule | linear_schedule | constant_schedule)`, which this replaces."""
    lr, warmup, n = hp["learning_rate"], hp["warmup_steps"], hp["decay_steps"]
    c = jnp.asarray(count, jnp.float32)
    start = lr / jnp.maximum(warmup, 1.0)
    warm = (start - lr) * (1 - jnp.clip(c, 0, warmup) / jnp.maximum(warmup, 1.0)) + lr
    t = c - warmup
    if decay == "cosine":
        alpha = hp["final_lr_ratio"]
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(t, n) / n))
        after = lr * ((1 - alpha) * cosine + alpha)
    elif decay == "linear":
        end = lr * hp["final_lr_ratio"]
        after = (lr - end) * (1 - jnp.clip(t, 0, n) / n) + end
    else:
        after = lr
    return jnp.where(c < warmup, warm, after)


def as_float32(tree):
    """`tree` with its floating leaves in float32 (the optimizer's working precision)."""
    return jax.tree.map(lambda x: x.astype(jnp.float32)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def apply_updates(params, updates):
    """`params + updates` computed in float32 and rounded once to each parameter's dtype."""
    return jax.tree.map(lambda p, u: (p.astype(jnp.float32) + u).astype(p.dtype),
                        params, updates)


def _clipped_adamw(learning_rate, b1, b2, eps, weight_decay, max_grad_norm, mask):
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                                   weight_decay=weight_decay, mask=mask))


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax transformation whose numeric hyperparameters are traced inputs of the step.

    `hparams`: the configured values (host floats) of `OPTIMIZER_HPARAMS`, the defaults the
    step is called with. `update(grads, state, params, hp)` first writes this update's values
    (the learning rate from the schedule at the state's update count) into the state of
    `optax.inject_hyperparams`. With `hparams` empty, `tx` is used as it is: its
    hyperparameters are the constants it closes over (and `hp` is ignored).

    `tx` always sees float32 params and gradients, so its state (Adam's moments) is float32
    and its updates are float32 whatever the parameters' dtype (see `apply_updates`)."""
    tx: optax.GradientTransformation
    hparams: Dict[str, float] = dataclasses.field(default_factory=dict)
    decay: str = "constant"

    def init(self, params):
        return self.tx.init(as_float32(params))

    def update(self, grads, state, params, hp):
        if self.hparams:
            values = {k: hp[k] for k in INJECTED}
            values["learning_rate"] = learning_rate(state.count, hp, self.decay)
            state = state._replace(hyperparams=values)
        return self.tx.update(as_float32(grads), state, as_float32(params))

    def schedule(self, count) -> float:
        """The learning rate of update `count` (host side, for logging)."""
        return float(learning_rate(count, self.hparams, self.decay))


def make_optimizer(cfg) -> Tuple[Optimizer, Callable[[int], float]]:
    """AdamW with linear warmup then `decay` ('cosine' | 'linear' | 'constant'), clipped by
    global norm; returns it and its learning-rate schedule (count -> lr)."""
    if cfg.decay not in DECAYS:
        raise ConfigError("learner.optimizer.decay", f"unknown schedule {cfg.decay!r}; "
                                                     f"valid: {list(DECAYS)}")
    hparams = dict(learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                   decay_steps=max(max(cfg.total_steps, 1) - cfg.warmup_steps, 1),
                   final_lr_ratio=cfg.final_lr_ratio, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                   weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
    hparams = {k: float(hparams[k]) for k in OPTIMIZER_HPARAMS}

    def decay_mask(params):  # no weight decay on norms and biases
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    # float32 hyperparameters whatever the parameters' dtype (a bf16 lr would be coarse).
    tx = optax.inject_hyperparams(_clipped_adamw, static_args=("mask",),
                                  hyperparam_dtype=jnp.float32)(
        **{k: hparams[k] for k in INJECTED}, mask=decay_mask)
    opt = Optimizer(tx, hparams, cfg.decay)
    return opt, opt.schedule


def _rounded_away(params, new_params, updates):
    """Fraction of parameters with a non-zero update whose stored value did not change."""
    count = lambda x: jnp.sum(x, dtype=jnp.float32)  # noqa: E731 - int32 overflows at 2^31
    lost = sum(count((u != 0) & (n == p)) for p, n, u in zip(
        jax.tree.leaves(params), jax.tree.leaves(new_params), jax.tree.leaves(updates)))
    moved = sum(count(u != 0) for u in jax.tree.leaves(updates))
    return lost / jnp.maximum(moved, 1.0)


def logp_and_entropy(logits, targets, temperature):
    """Per-token log-prob of `targets` and entropy, from one log-softmax of logits / T."""
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def trained_and_frozen(model_state):
    """(trained params, frozen base or None) of a model's state, as pure dicts: with LoRA
    adapters only they train and the rest is the frozen base, else every `Param` trains."""
    if jax.tree.leaves(model_state.filter(nnx.LoRAParam)):
        return (nnx.to_pure_dict(model_state.filter(nnx.LoRAParam)),
                nnx.to_pure_dict(model_state.filter(nnx.All(nnx.Param,
                                                            nnx.Not(nnx.LoRAParam)))))
    return nnx.to_pure_dict(model_state.filter(nnx.Param)), None


def abstract_state(abstract_model, optimizer, mesh: Mesh, rules=sharding_lib.DEFAULT_RULES):
    """The state `init_state` would build for `abstract_model` (from `nnx.eval_shape`), as
    `ShapeDtypeStruct`s carrying the same shardings: what the step is AOT-compiled for
    (`experiments/compile_check.py`) without allocating a weight."""
    shardings = nnx.to_pure_dict(sharding_lib.state_shardings(nnx.state(abstract_model),
                                                              mesh, rules))

    def placed(tree, like):
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            tree, like)
    params, frozen = trained_and_frozen(nnx.state(abstract_model))
    params = placed(params, _subtree(shardings, params))
    abstract_opt = jax.eval_shape(optimizer.init, params)
    opt_state = placed(abstract_opt, opt_state_shardings(params, abstract_opt, mesh))
    step = jax.ShapeDtypeStruct((), jnp.int32,
                                sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    if frozen is not None:
        return LoRATrainState(params, opt_state, step, placed(frozen, _subtree(shardings, frozen)))
    return TrainState(params, opt_state, step)


def _subtree(full: dict, part: dict) -> dict:
    """The entries of nested dict `full` at the keys of nested dict `part`."""
    return {k: _subtree(full[k], v) if isinstance(v, dict) else full[k] for k, v in part.items()}


def opt_state_shardings(params, abstract_opt, mesh: Mesh):
    """Shardings of the optimizer state `abstract_opt` of `params` (arrays or
    `ShapeDtypeStruct`s carrying their shardings): a moment takes the sharding of the
    parameter it mirrors (found by path suffix and shape), everything else is replicated."""
    by_path = {tuple(p): (x.shape, x.sharding)
               for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def sharding_for(path, leaf):
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(sharding_for, abstract_opt)


def init_state(model, optimizer, mesh: Mesh) -> TrainState:
    """The initial state, every leaf placed explicitly on `mesh`.

    Optimizer moments (float32 whatever the params' dtype) take the sharding of the parameter
    they mirror (found by path suffix and shape), everything else is replicated. Explicit
    placement matters beyond memory: a leaf left uncommitted on the first call would differ
    in type from the step's output and cost a recompilation on the second call.
    """
    params, frozen = trained_and_frozen(nnx.state(model))
    opt_sharding = opt_state_shardings(params, jax.eval_shape(optimizer.init, params), mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sharding)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32),
                          NamedSharding(mesh, jax.sharding.PartitionSpec()))
    if frozen is not None:
        return LoRATrainState(params, opt_state, step, frozen)
    return TrainState(params, opt_state, step)


def state_shardings(state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)


def batch_shardings(mesh: Mesh, rules=sharding_lib.DEFAULT_RULES) -> Dict[str, NamedSharding]:
    """Sharding of each packed batch array `[chunks, rows, ...]`: rows split over the batch
    mesh axes."""
    chunk = NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, *sharding_lib.logical_to_spec(("batch",), rules)))
    return {k: chunk for k in PACKED_KEYS + SEQ_KEYS}


def place_batch(arrays: Dict[str, Any], mesh: Mesh,
                rules=sharding_lib.DEFAULT_RULES) -> Dict[str, jax.Array]:
    """The packed host batch (the same on every process) as global arrays: each process puts
    only the rows its own devices hold."""
    shardings = batch_shardings(mesh, rules)
    return {k: jax.make_array_from_callback(x.shape, shardings[k], lambda idx, x=x: x[idx])
            for k, x in arrays.items()}


class TrainStep:
    """The jitted step `(state, batch, hparams) -> (state, metrics)` with its default traced
    hyperparameters bound: `step(state, batch)` runs with the configured values,
    `step(state, batch, hparams)` runs the same executable with others.

    `hparams` = {"optimizer": {name: float32 scalar}, "loss": {name: float32 scalar}}: the
    optimizer's `OPTIMIZER_HPARAMS` and the loss's `traced_hparams` (clip ranges, caps,
    kl_coef, ...). Structural choices (loss name, aggregation, schedule kind, minibatches,
    shapes) are compiled in; these values are not."""

    def __init__(self, jitted, hparams: dict, sharding):
        self.jitted = jitted
        self.hparams = hparams_tree(hparams)  # host values (an AOT compile reads their shapes)
        self._sharding = sharding
        self._placed = None  # the defaults on device, placed at the first call

    def __call__(self, state, batch, hparams: Optional[dict] = None):
        if hparams is None:
            if self._placed is None:
                self._placed = jax.device_put(self.hparams, self._sharding)
            hp = self._placed
        else:
            hp = jax.device_put(hparams_tree(hparams), self._sharding)
        return self.jitted(state, batch, hp)

    def __getattr__(self, name):  # lower, _cache_size, ... of the jitted function
        return getattr(self.jitted, name)


def hparams_tree(hparams: dict) -> dict:
    """{"optimizer": {...}, "loss": {...}} of float32 scalars (numpy), from host numbers."""
    return {group: {k: np.float32(v) for k, v in values.items()}
            for group, values in hparams.items()}


def make_train_step(graphdef, optimizer, loss_fn: Callable, *, mesh: Mesh,
                    state_sharding, temperature: float = 1.0, minibatches: int = 1,
                    micro_batches: int = 1, use_proximal: bool = False,
                    token_weighted: bool = True, rules=sharding_lib.DEFAULT_RULES):
    """Returns the jitted step (a `TrainStep`: `step(state, batch[, hparams])`).

    `loss_fn(LossInputs, hparams) -> (loss, metrics)` from `pipelinerl_jax.losses`, its
    numeric hyperparameters traced (`loss_fn.traced_hparams`); `optimizer` from
    `make_optimizer` (or an `Optimizer` wrapping a plain optax transformation). `batch` is
    `batching.pack(..., chunks=minibatches * micro_batches)`'s arrays: packed rows
    `[chunks, R, T]` for the model and per-sequence `[chunks, N/chunks, C]` for the loss.
    One jit compilation per distinct R (row bucket).
    """
    from pipelinerl_jax.losses import LossInputs
    from pipelinerl_jax.losses.vcpo import opob_baselines, sequence_log_weight

    row_sharding = sharding_lib.batch_sharding(mesh, rules)
    scales_step = bool(getattr(loss_fn, "scales_step", False))
    baseline = getattr(loss_fn, "baseline", "none")

    def merged(params, frozen):
        """The model of `params` (with the frozen LoRA base, or None)."""
        return nnx.merge(graphdef, params) if frozen is None else \
            nnx.merge(graphdef, frozen, params)

    def packed_logp(params, frozen, mb):
        """Log-probs and entropies of the packed rows, gathered to `[N, C]` sequence rows
        (`frozen`: the LoRA base, or None)."""
        model = merged(params, frozen)
        ids = jax.lax.with_sharding_constraint(mb["input_ids"], row_sharding)
        logits = model(ids, positions=mb["positions"], segment_ids=mb["segment_ids"])
        logp, entropy = logp_and_entropy(logits, mb["targets"], temperature)
        idx = mb["gather_idx"]
        return jnp.take(logp.reshape(-1), idx), jnp.take(entropy.reshape(-1), idx)

    def micro_loss(params, frozen, mb, loss_hp):
        logp, entropy = packed_logp(params, frozen, mb)
        if not use_proximal:
            proximal = None
        elif "logp_proximal" in mb:
            proximal = mb["logp_proximal"]
        else:  # one update per batch: the proximal policy is the current one
            proximal = jax.lax.stop_gradient(logp)
        inputs = LossInputs(logp=logp, logp_behaviour=mb["logp_behaviour"],
                            logp_proximal=proximal, advantages=mb["advantages"],
                            loss_mask=mb["loss_mask"], lag=mb["lag"],
                            entropy=jax.lax.stop_gradient(entropy), engine=mb["engine"])
        return loss_fn(inputs, loss_hp)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def row_logp(params, frozen, mb, row):
        """Log-probs of packed row `row` of `mb` alone, `[pack_len]` (no row sharding: one
        row). Rows are independent (attention stays inside a segment), so a sequence's
        log-probs, and their gradient, are the same as in the whole packed micro-batch."""
        model = merged(params, frozen)
        take = lambda k: jax.lax.dynamic_slice_in_dim(mb[k], row, 1)  # noqa: E731
        logits = model(take("input_ids"), positions=take("positions"),
                       segment_ids=take("segment_ids"))
        logp, _ = logp_and_entropy(logits, take("targets"), temperature)
        return logp[0]

    def sequence_stats(params, frozen, mb):
        """([n] squared norm of each sequence's ∇_θ Σ_t m_t log π_θ(t), [n] its log W) of
        micro-batch `mb`: per sequence (a `lax.map`, one gradient at a time) a forward and a
        backward of the one packed row that holds it, keeping only the squared norm. (A
        backward of the whole micro-batch per sequence, as before, costs rows times more.)"""
        pack_len = mb["input_ids"].shape[-1]
        mask = jnp.where(mb["loss_mask"] > 0, mb["loss_mask"], 0.0).astype(jnp.float32)

        def sq_norm(i):
            idx = mb["gather_idx"][i]
            row = idx[0] // pack_len  # every token of a sequence is on one row

            def logp_of(p):
                return jnp.take(row_logp(p, frozen, mb, row), idx - row * pack_len, mode="clip")
            logp_i, pullback = jax.vjp(logp_of, params)
            (grads,) = pullback(mask[i].astype(logp_i.dtype))
            return sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                       for g in jax.tree.leaves(grads))

        sq = jax.lax.map(sq_norm, jnp.arange(mask.shape[0]))
        if use_proximal and "logp_proximal" in mb:
            prox = mb["logp_proximal"]
        else:  # the proximal policy is the current one: one forward of the micro-batch
            prox = packed_logp(params, frozen, mb)[0]
        return sq, sequence_log_weight(jax.lax.stop_gradient(prox), mb["logp_behaviour"],
                                       mb["loss_mask"])

    def baselined_advantages(state, micro, loss_hp):
        """`micro` with VCPO's off-policy optimal baseline of each row's group (over the
        minibatch, across its micro-batches) subtracted from its advantages; and the mean
        |baseline| over rows with trained tokens."""
        sq, log_w = jax.lax.map(
            lambda mb: sequence_stats(state.params, frozen_params(state), mb), micro)
        trained = micro["loss_mask"] > 0  # [M, n, C]
        valid = jnp.any(trained, axis=-1)
        first = jnp.argmax(trained, axis=-1)[..., None]
        adv = jnp.take_along_axis(micro["advantages"], first, axis=-1)[..., 0]
        flat = lambda a: a.reshape(-1)  # noqa: E731
        cap = loss_hp.get("cap", loss_fn.hparams["cap"])
        b = opob_baselines(flat(sq), flat(log_w), flat(adv), flat(micro["group"]),
                           flat(valid), cap, baseline).reshape(valid.shape)
        micro = dict(micro, advantages=micro["advantages"] - b[..., None])
        shift = jnp.sum(jnp.abs(b)) / jnp.maximum(jnp.sum(valid), 1)
        return micro, shift

    def minibatch_update(state: TrainState, micro, hp):
        """One optimizer update from the micro-batches `micro` (leading dim M)."""
        if baseline != "none":
            micro, baseline_shift = baselined_advantages(state, micro, hp["loss"])
        tokens = jnp.sum(micro["loss_mask"], axis=(1, 2))
        weights = (tokens / jnp.maximum(jnp.sum(tokens), 1.0) if token_weighted
                   else jnp.full((micro_batches,), 1.0 / micro_batches))

        def body(acc, xs):
            one, w = xs
            (loss, metrics), grads = grad_fn(state.params, frozen_params(state), one,
                                             hp["loss"])
            acc_grads, acc_loss, acc_metrics = acc
            acc_grads = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), acc_grads,
                                     grads)
            acc_metrics = jax.tree.map(lambda a, m: a + w * m, acc_metrics, metrics)
            return (acc_grads, acc_loss + w * loss, acc_metrics), None

        first = jax.tree.map(lambda x: x[0], micro)
        metrics_shape = jax.eval_shape(
            lambda: micro_loss(state.params, frozen_params(state), first, hp["loss"])[1])
        zeros = (jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), state.params),
                 jnp.zeros((), jnp.float32),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape))
        (grads, loss, metrics), _ = jax.lax.scan(body, zeros, (micro, weights))

        grad_norm = optax.global_norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params,
                                            hp["optimizer"])
        if scales_step:  # e.g. VCPO's ESS-scaled step: for AdamW, lr times the scale
            updates = jax.tree.map(lambda u: u * metrics["step_scale"], updates)
        new_params = apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
        new_state = state._replace(params=keep(new_params, state.params),
                                   opt_state=keep(new_opt, state.opt_state),
                                   step=state.step + ok.astype(jnp.int32))
        metrics = dict(metrics)
        metrics.update(loss=loss, grad_norm=grad_norm, skipped=1.0 - ok.astype(jnp.float32))
        if baseline != "none":
            metrics["vcpo_baseline_abs"] = baseline_shift
        if any(jnp.dtype(p.dtype).itemsize < 4 for p in jax.tree.leaves(state.params)):
            metrics["update_rounded_away"] = _rounded_away(state.params, new_params, updates)
        return new_state, metrics

    def step(state: TrainState, batch: Dict[str, jax.Array], hp):
        batch = dict(batch)
        if use_proximal and minibatches > 1:  # fixed once, before the first update (AReaL)
            current = jax.lax.stop_gradient(state.params)
            batch["logp_proximal"] = jax.lax.map(
                lambda mb: packed_logp(current, frozen_params(state), mb)[0], batch)
        split = lambda x: x.reshape((minibatches, micro_batches) + x.shape[1:])  # noqa
        state, metrics = jax.lax.scan(lambda st, mb: minibatch_update(st, mb, hp), state,
                                      jax.tree.map(split, batch))
        out = {k: jnp.mean(v, axis=0) for k, v in metrics.items()}  # over minibatches
        out["skipped"] = jnp.sum(metrics["skipped"])
        return state, out

    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(step, in_shardings=(state_sharding, batch_shardings(mesh, rules),
                                         replicated),
                     out_shardings=(state_sharding, replicated), donate_argnums=0)
    hparams = {"optimizer": dict(optimizer.hparams), "loss": dict(loss_fn.traced_hparams)}
    return TrainStep(jitted, hparams, replicated)
