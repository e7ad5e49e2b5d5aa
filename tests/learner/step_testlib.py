"""The learner's train step as a run config builds it (`loop.make_step`), on a tiny model and
hand-made rollouts, shared by the learner tests.

Compiling the step is most of a test's time, and many tests differ only in their data (a
batch's lag, its rollouts): `_train` keeps one compiled step per (learner, loss, sampling)
config for the whole session, so tests in any file that train the same config share it.
Each call still starts from a fresh model and optimizer state.
"""
import jax
import numpy as np
from flax import nnx

from pipelinerl_jax import sharding
from pipelinerl_jax.learner import batching, loop, train_step as ts
from pipelinerl_jax.models import tiny_config
from pipelinerl_jax.models.factory import create_model
from pipelinerl_jax.records import Rollout

VOCAB = 40
MODEL = tiny_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4,
                    num_kv_heads=2, head_dim=16)
_STEPS = {}  # config -> (optimizer, compiled step)


def _rollouts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Rollout(prompt_ids=rng.integers(3, VOCAB, 4).astype(np.int32),
                    completion_ids=rng.integers(3, VOCAB, c).astype(np.int32),
                    logp_behaviour=-rng.uniform(0.5, 4.0, c).astype(np.float32),
                    version=np.zeros(c, np.int32), kv_version=np.zeros(c, np.int32),
                    reward=float(i % 2), advantage=float(rng.normal()),
                    group_id=f"g-{i // 4}", group_size=4)
            for i, c in enumerate(lengths)]


def _train(cfg, rollouts, steps=2):
    """`steps` train steps of `cfg` on `rollouts` from a fresh model (seed 3): (params,
    losses, the packed batch)."""
    mesh = sharding.make_mesh((1, 1, 1))
    model = create_model(MODEL, mesh, seed=3)
    key = (cfg.learner.to_json(), cfg.loss.to_json(), cfg.sampling.temperature)
    if key not in _STEPS:
        optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
        state = ts.init_state(model, optimizer, mesh)
        _STEPS[key] = optimizer, loop.make_step(cfg, model, optimizer, mesh, state)
    optimizer, step_fn = _STEPS[key]
    state = ts.init_state(model, optimizer, mesh)
    chunks = cfg.learner.minibatches * cfg.learner.micro_batches
    packed = batching.pack(rollouts, 0, num_seqs=len(rollouts), chunks=chunks, pack_len=32,
                           completion_len=24)
    losses = []
    for _ in range(steps):
        state, metrics = step_fn(state, packed.arrays)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses, packed


def one_step(cfg, arrays):
    """(initial params, params after one train step of `cfg` on packed `arrays`, the step's
    metrics, the model's graphdef): the tiny model, seed 3, one device."""
    mesh = sharding.make_mesh((1, 1, 1))
    model = create_model(MODEL, mesh, seed=3)
    optimizer, _ = ts.make_optimizer(cfg.learner.optimizer)
    state = ts.init_state(model, optimizer, mesh)
    params0 = jax.device_get(state.params)
    step_fn = loop.make_step(cfg, model, optimizer, mesh, state)
    state, metrics = step_fn(state, arrays)
    return params0, jax.device_get(state.params), jax.device_get(metrics), nnx.graphdef(model)


def param_delta(before, after):
    """`after - before` leaf by leaf, in float64 (what one update moved)."""
    return jax.tree.map(lambda a, b: np.asarray(b, np.float64) - np.asarray(a, np.float64),
                        before, after)


def max_abs(tree) -> float:
    return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(tree))


def max_diff(a, b) -> float:
    """max |a - b| over every leaf of two trees of the same structure."""
    return max_abs(jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), a, b))
