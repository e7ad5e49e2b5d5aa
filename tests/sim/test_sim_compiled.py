"""The simulator's step costs from a compile check's JSON (sim/compiled.py).

Oracle: a JSON whose FLOPs and bytes are the datasheet roofline's own formulas
(`latency.DecodeLatency.roofline` on one chip) must give back exactly that latency model;
and the run config key `costs_from` drives `build_setup`."""
import json

import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.sim import compiled
from pipelinerl_jax.sim.sim_config import build_setup, default_config
from pipelinerl_jax.sim.hardware import ACCELERATORS, MODELS
from pipelinerl_jax.sim.latency import DecodeLatency


def _costs(model, rows=64, lengths=(64, 2048), train_per_token_s=3e-6, chips=4,
           engine_chips=1):
    """What a compile check reports for `model` if XLA counted exactly the roofline's terms."""
    decode = [dict(rows=rows, cache_len=s, step_s=0.0,
                   bytes_accessed=model.weights_total_bytes + model.kv_bytes_per_token * rows * s,
                   flops=2 * model.params * rows + model.attn_flops_per_token_per_ctx * rows * s)
              for s in lengths]
    return {"estimates": {"sim_costs": dict(decode=decode, engine_chips=engine_chips,
                                            train_per_token_s=train_per_token_s,
                                            learner_chips=chips)}}


def _write(tmp_path, obj, log_lines=()):
    path = tmp_path / "check.json"
    path.write_text("".join(f"{ln}\n" for ln in log_lines) + json.dumps(obj) + "\n")
    return str(path)


def test_costs_at_the_rooflines_own_terms_give_back_the_roofline(tmp_path):
    acc, model = ACCELERATORS["tpu-v5e"], MODELS["qwen2.5-7b"]
    path = _write(tmp_path, _costs(model), log_lines=["compiling 5 programs: ..."])
    got = compiled.decode_latency(compiled.read_costs(path), acc)
    want = DecodeLatency.roofline(acc, model, tp=1)
    for field in ("mem_fixed_s", "mem_per_ctx_s", "cmp_per_seq_s", "cmp_per_ctx_s"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9), field
    batch, ctx = np.array([1, 64, 256]), np.array([500, 64 * 900, 256 * 3000])
    np.testing.assert_allclose(got.step_time(batch, ctx), want.step_time(batch, ctx))
    train = compiled.train_time(compiled.read_costs(path), acc)
    assert train.step_time(1e6, 4) == pytest.approx(3e-6 * 4 / acc.train_mfu * 1e6 / 4)


def test_costs_from_replaces_the_datasheet_model_in_the_setup(tmp_path):
    c = default_config()
    c.hardware.preset, c.model.preset = "tpu-v5e", "qwen2.5-7b"
    c.devices, c.split.samplers, c.split.trainers = 8, 4, 4
    c.train.state_bytes_per_param = 2.0
    c.rollout.max_new_tokens = 2048
    c.rollout.devices_per_engine = 2  # 15 GB of bf16 weights: two v5e chips an engine
    c.lengths.median, c.lengths.tail = 300.0, 1500.0
    costs = _costs(MODELS["qwen2.5-7b"], engine_chips=2)
    costs["estimates"]["sim_costs"]["decode"][0]["bytes_accessed"] *= 3  # not the roofline
    c.costs_from = _write(tmp_path, costs)
    s = build_setup(c)
    assert s.decode == compiled.decode_latency(compiled.read_costs(c.costs_from),
                                               ACCELERATORS["tpu-v5e"])
    assert s.decode != DecodeLatency.roofline(ACCELERATORS["tpu-v5e"], MODELS["qwen2.5-7b"])
    c.rollout.devices_per_engine = 4
    with pytest.raises(ConfigError, match="rollout.devices_per_engine"):
        build_setup(c)


def test_a_json_without_two_decode_lengths_or_a_train_step_names_the_key(tmp_path):
    model = MODELS["qwen2.5-0.5b"]
    one = _costs(model, lengths=(256,))
    with pytest.raises(ConfigError, match="costs_from.*two attention lengths"):
        compiled.read_costs(_write(tmp_path, one))
    with pytest.raises(ConfigError, match="costs_from"):
        compiled.read_costs(str(tmp_path / "missing.json"))
    # a quick check (`--fast`) has every field, but its train step's cost is another plan's
    quick = dict(_costs(model), plan="quick")
    with pytest.raises(ConfigError, match="costs_from.*quick compile check"):
        compiled.read_costs(_write(tmp_path, quick))
    assert compiled.read_costs(_write(tmp_path, dict(_costs(model), plan="full")))
