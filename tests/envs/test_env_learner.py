"""The learner side of multi-turn episodes: the run config's `env` section, packing with the
episode's loss mask, losses and diagnostics that see only model tokens (sequence-level ones
included), per-turn metrics, and a warm start that never trains on tool replies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.envs import CalculatorTask, build_task, encode_demonstration, is_env_task
from pipelinerl_jax.launch.demonstrations import demo_rollouts
from pipelinerl_jax.learner import batching
from pipelinerl_jax.losses import LOSSES, LossInputs, get_loss
from pipelinerl_jax.run_config import base_config, completion_tokens, resolve, validate
from pipelinerl_jax.tasks import SyntheticStringTask
from pipelinerl_jax.records import Rollout


def agent_config(**env):
    cfg = base_config()
    cfg.task.name = "calculator"
    cfg.model.max_seq_len = 128
    cfg.env.update(env)
    return cfg


def test_task_name_picks_an_environment_configured_by_the_env_section():
    cfg = agent_config(max_ops=2, max_episode_tokens=100)
    validate(cfg)
    task = build_task(cfg)
    assert isinstance(task, CalculatorTask) and task.max_ops == 2 and is_env_task(cfg)
    assert completion_tokens(cfg) == 100 == resolve(cfg).transport.max_completion_tokens
    cfg.env.max_episode_tokens = 0  # the engine's context
    assert completion_tokens(cfg) == 128
    cfg.task.name = "kv_lookup"
    validate(cfg)
    cfg.task.name = "reverse"  # back to a single-turn task: the env section is ignored
    assert not is_env_task(cfg) and isinstance(build_task(cfg), SyntheticStringTask)
    assert completion_tokens(cfg) == cfg.sampling.max_new_tokens
    assert "name" not in base_config().env  # task.name is the one switch


@pytest.mark.parametrize("change,key", [
    (dict(max_ops=9), "env.max_ops"),
    (dict(max_episode_tokens=200), "env.max_episode_tokens"),  # > model.max_seq_len
    (dict(max_episode_tokens=30), "env.max_episode_tokens"),  # no room for a correct episode
    (dict(max_turn_tokens=0), "env.max_turn_tokens"),
    (dict(tool_timeout_s=0.0), "env.tool_timeout_s"),
    (dict(tool_threads=0), "env.tool_threads"),
    (dict(typo=1), "env.typo"),
])
def test_env_errors_name_the_key(change, key):
    cfg = agent_config()
    for k, v in change.items():
        cfg.env[k] = v
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key, str(e.value)


@pytest.mark.parametrize("key", ["model.max_seq_len", "engine.max_seq_len"])
def test_no_episode_budget_names_the_key_that_set_the_context(key):
    cfg = agent_config(max_episode_tokens=0)
    section, leaf = key.split(".")
    cfg[section][leaf] = 40  # the run's context, or only the engine's (a shorter cache)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key, str(e.value)


def episode_rollout(rng, segments, version=3, advantage=0.5):
    """A rollout whose completion alternates model (mask 1) and env (mask 0) spans."""
    mask = np.concatenate([np.full(n, k % 2 == 0, np.uint8) for k, n in enumerate(segments)])
    turn = np.concatenate([np.full(n, k // 2, np.int32) for k, n in enumerate(segments)])
    c = len(mask)
    return Rollout(prompt_ids=rng.integers(3, 40, 4).astype(np.int32),
                   completion_ids=rng.integers(3, 40, c).astype(np.int32),
                   logp_behaviour=np.where(mask == 1, -rng.uniform(0.1, 3, c), 0.0)
                   .astype(np.float32), version=(version + turn).astype(np.int32),
                   kv_version=np.full(c, version, np.int32), reward=1.0, advantage=advantage,
                   group_id="g", group_size=2, loss_mask=mask, turn_index=turn,
                   metrics={"turns": float(turn[-1] + 1), "end/done": 1.0})


def test_pack_trains_model_tokens_and_keeps_env_tokens_as_context():
    rng = np.random.default_rng(0)
    eps = [episode_rollout(rng, [5, 3, 4]), episode_rollout(rng, [2, 6, 3, 2, 1])]
    single = Rollout(prompt_ids=np.array([1, 2], np.int32), completion_ids=np.array([5, 6, 7],
                     np.int32), logp_behaviour=-np.ones(3, np.float32),
                     version=np.full(3, 4, np.int32), kv_version=np.full(3, 4, np.int32),
                     reward=0.0, advantage=-1.0, group_id="h", group_size=1)
    packed = batching.pack(eps + [single], 6, num_seqs=4, chunks=1, pack_len=32,
                           completion_len=20)
    a = packed.arrays
    assert packed.num_tokens == 9 + 6 + 3  # model tokens only
    for i, r in enumerate(eps + [single]):
        c = len(r.completion_ids)
        want = np.ones(c) if r.loss_mask is None else r.loss_mask
        np.testing.assert_array_equal(a["loss_mask"][0, i, :c], want)
        assert a["loss_mask"][0, i, c:].sum() == 0
        # every completion token, env ones included, is in the packed row as input
        flat = a["input_ids"].reshape(-1)
        np.testing.assert_array_equal(flat[a["gather_idx"][0, i, :c] + 1], r.completion_ids)
    m = batching.episode_metrics(eps + [single], 6)
    assert m["lag/turn_0/mean"] == 3.0 and m["lag/turn_1/mean"] == 2.0
    assert m["lag/turn_2/max"] == 1 and "lag/turn_3/mean" not in m  # turn 2: model tokens only
    assert m["episode/turns_mean"] == 2.5 and m["episode/end_done"] == 1.0
    assert m["episode/env_tokens_mean"] == (3 + 6 + 2) / 2
    assert batching.episode_metrics([single], 6) == {}


def _compact(x, mask):
    """Each row's model tokens moved to its front (what a single-turn row of only those
    tokens would be), zeros after."""
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        k = int(mask[b].sum())
        out[b, :k] = x[b][mask[b] > 0]
    return out


def _configs():
    for name in sorted(LOSSES):
        if name == "gspo":
            yield name, {}
        else:
            for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
                yield name, {"agg": agg}


@pytest.mark.parametrize("name,hp", list(_configs()))
def test_losses_and_diagnostics_see_only_model_tokens(name, hp):
    """An episode row (env spans masked) gives exactly the loss, diagnostics and gradient of
    the row made of its model tokens alone: sequence-level terms (gspo, seq_mean_*,
    sequence tis, seq_ess) count only model tokens."""
    rng = np.random.default_rng(1)
    B, T = 4, 24
    mask = np.zeros((B, T), np.float32)
    for b in range(B):  # alternating model / env spans, ragged
        pos = 0
        for k in range(6):
            n = int(rng.integers(1, 4))
            mask[b, pos:pos + n] = k % 2 == 0
            pos += n
    mu = -rng.uniform(0.05, 3.0, (B, T))
    prox = mu + rng.normal(0, 0.5, (B, T))
    raw = dict(logp=prox + rng.normal(0, 0.3, (B, T)), logp_behaviour=mu, logp_proximal=prox,
               advantages=np.repeat(rng.normal(0, 1, (B, 1)), T, 1), loss_mask=mask,
               lag=rng.integers(0, 6, (B, T)), entropy=rng.exponential(1.0, (B, T)))
    off = mask == 0  # what env tokens carry: neutral provenance, any policy value
    episode = dict(raw, logp_behaviour=np.where(off, 0.0, mu), lag=np.where(off, 0, raw["lag"]))
    compact = {k: _compact(v, mask) for k, v in raw.items()}
    compact["loss_mask"] = _compact(np.ones_like(mask), mask)

    loss_fn = get_loss(name, diagnostics=True, **hp)

    def run(inputs):
        x = LossInputs(**{k: jnp.asarray(v, jnp.int32 if k == "lag" else jnp.float32)
                          for k, v in inputs.items()})
        (loss, metrics), grad = jax.value_and_grad(
            lambda lp: loss_fn(x._replace(logp=lp)), has_aux=True)(x.logp)
        return float(loss), jax.device_get(metrics), np.asarray(grad)

    loss_e, met_e, grad_e = run(episode)
    loss_c, met_c, grad_c = run(compact)
    np.testing.assert_allclose(loss_e, loss_c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_compact(grad_e, mask), grad_c, rtol=1e-5, atol=1e-7)
    assert np.all(grad_e[off] == 0)
    for k in met_c:
        np.testing.assert_allclose(met_e[k], met_c[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_warm_start_demonstrations_mask_the_tool_replies(tok):
    cfg = agent_config()
    task = build_task(cfg)
    demos = demo_rollouts(task, tok, seed=0)
    for problem in [p for p, _ in zip(task.problems(0), range(5))]:
        r = next(demos)
        prompt, ids, mask = encode_demonstration(task, tok, problem)
        np.testing.assert_array_equal(r.completion_ids, ids)
        np.testing.assert_array_equal(r.loss_mask, mask)
        np.testing.assert_array_equal(r.prompt_ids, prompt)
        assert tok.decode(ids[mask == 0]).count("=") == len(problem.meta["steps"])
        assert "=" not in tok.decode(ids[mask == 1])  # the model never learns to write results
    rows = [next(demos) for _ in range(4)]
    packed = batching.pack(rows, 0, num_seqs=4, chunks=1, pack_len=128,
                           completion_len=completion_tokens(cfg))
    assert packed.num_tokens == packed.arrays["loss_mask"].sum() == sum(
        r.loss_mask.sum() for r in rows) < sum(len(r.completion_ids) for r in rows)
