"""The parts of the multi-process learner and of standalone roles that need no second JAX
process: the learner group's supervision (on tiny Python children), each process's
environment, the batch's wire form, the config keys, and a role's standalone config."""
import json
import sys
import time

import numpy as np
import pytest

from pipelinerl_jax import run_config
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.launch import __main__ as role_main
from pipelinerl_jax.launch.learner_group import LearnerGroup, process_env, warm_start_env
from pipelinerl_jax.launch.standalone import prepare
from pipelinerl_jax.launch.supervisor import LaunchError
from pipelinerl_jax.learner import multihost
from pipelinerl_jax.transport import queue_address, weights_address
from pipelinerl_jax.transport.queue_client import Batch, QueueUnavailable
from pipelinerl_jax.records import Rollout
from tests.pipeline_testlib import ROOT, make_init_checkpoint


def _config(**launch):
    cfg = run_config.base_config()
    cfg.mesh.shape = (2, 2, 1)
    cfg.learner.batch_groups, cfg.rollout.group_size = 2, 4
    cfg.launch.update(launch)
    return cfg


# ------------------------------------------------------------------ the learner group

def _group(tmp_path, codes, **launch):
    """A 2-process group whose children run `codes[i]` instead of the learner."""
    group = LearnerGroup(_config(learner_processes=2, **launch), str(tmp_path))
    for c, code in zip(group.children, codes):
        c.cmd = [sys.executable, "-c", code]
    return group


def _events(tmp_path):
    with open(tmp_path / "events.jsonl") as f:
        return [json.loads(line) for line in f]


def _poll(group, timeout=30.0):
    deadline = time.time() + timeout
    while (code := group.poll()) is None:
        assert time.time() < deadline
        time.sleep(0.05)
    return code


@pytest.mark.slow  # starts child processes
def test_a_dead_learner_process_takes_its_group_down_and_the_group_restarts(tmp_path):
    sleeper = "import time; time.sleep(120)"  # blocked, like a survivor in a collective
    group = _group(tmp_path, [sleeper, "import sys; print('boom', flush=True); sys.exit(3)"],
                   shutdown_timeout_s=1.0).start()
    assert [c.name for c in group.children] == ["learner0", "learner1"]
    assert _poll(group) == 3
    assert all(c.poll() is not None for c in group.children)  # never a half group
    group.restart(3, limit=1)
    assert all(c.poll() is None or c.poll() == 3 for c in group.children)
    assert _poll(group) == 3
    with pytest.raises(LaunchError, match=r"learner1 exited with 3 and was restarted 1 "
                                          r"times(.|\n)*boom"):
        group.restart(3, limit=1)
    events = [(e["event"], e["child"]) for e in _events(tmp_path)
              if e["event"] in ("start", "exit")]  # stop events time the shutdown
    assert events == [("start", "learner0"), ("start", "learner1"),
                      ("exit", "learner1"), ("exit", "learner0")] * 2
    assert "restarting the learner group (restart 1)" in \
        open(group.children[0].log_path).read()


@pytest.mark.slow  # starts child processes
def test_a_group_is_done_when_every_process_exited_zero(tmp_path):
    group = _group(tmp_path, ["pass", "import time; time.sleep(1)"]).start()
    assert group.poll() is None or group.children[1].poll() == 0
    assert _poll(group) == 0


def test_each_process_gets_the_standard_jax_variables_and_its_share_of_devices(tmp_path):
    base = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8", "A": "b"}
    env = process_env(base, 1, 2, "127.0.0.1:1234", 2)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
    assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"],
            env["JAX_PROCESS_ID"], env["A"]) == ("127.0.0.1:1234", "2", "1", "b")
    group = LearnerGroup(_config(learner_processes=2), str(tmp_path), env=base)
    assert group.cpu_devices == 2  # mesh (2, 2, 1) over 2 processes
    single = LearnerGroup(_config(), str(tmp_path))
    assert [c.name for c in single.children] == ["learner"] and single.children[0].env is None
    # The warm start is one process on the whole mesh.
    assert warm_start_env(_config(learner_processes=2), base)["XLA_FLAGS"] == \
        "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    assert warm_start_env(_config(), None) is None


def test_learner_processes_must_share_the_mesh_equally():
    run_config.validate(_config(learner_processes=2))
    run_config.validate(_config(learner_processes=4))
    with pytest.raises(ConfigError, match=r"launch.learner_processes: 3 processes cannot "
                                          r"share the 4 devices"):
        run_config.validate(_config(learner_processes=3))
    with pytest.raises(ConfigError, match="launch.learner_processes"):
        run_config.validate(_config(learner_processes=0))


# ------------------------------------------------------------------ the batch

def _batch():
    rollouts = [Rollout(prompt_ids=np.arange(3, dtype=np.int32),
                        completion_ids=np.array([5, 6], np.int32),
                        logp_behaviour=np.array([-0.5, -1.25], np.float32),
                        version=np.array([2, 3], np.int32),
                        kv_version=np.array([2, 2], np.int32), reward=1.0, advantage=0.5,
                        group_id=f"w0-abc-{g}", group_size=1, task_id="t", start_version=2,
                        metrics={"correct": 1.0}) for g in range(2)]
    return Batch("b-7", rollouts, 2, 3, True, 2)


def test_a_batch_crosses_to_the_other_processes_as_the_queues_wire_bytes():
    batch = _batch()
    back = multihost.decode_batch(multihost.encode_batch(batch))
    assert (back.batch_id, back.num_groups, back.learner_version, back.redelivered,
            back.delivery_count) == ("b-7", 2, 3, True, 2)
    for a, b in zip(batch.rollouts, back.rollouts):
        for k in ("prompt_ids", "completion_ids", "logp_behaviour", "version", "kv_version"):
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
        assert (a.group_id, a.reward, a.advantage, a.metrics) == \
            (b.group_id, b.reward, b.advantage, b.metrics)
    assert [multihost._bucket(n) for n in (1, 4096, 4097, 70000)] == [4096, 4096, 8192, 131072]


class _Queue:
    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def get_batch(self, *args, **kwargs):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_feed_of_one_process_pulls_counts_outages_and_stops_without_pulling():
    import grpc
    batch = _batch()
    queue = _Queue(QueueUnavailable(grpc.StatusCode.UNAVAILABLE, "restarting"), batch)
    feed = multihost.BatchFeed(queue)
    assert feed.next(2, 1.0, 0, stop=False) == (None, False) and feed.unavailable == 1
    assert feed.next(2, 1.0, 0, stop=False) == (batch, False)
    assert feed.next(2, 1.0, 0, stop=True) == (None, True) and queue.calls == 2
    assert multihost.NullQueue().get_batch(2, timeout_s=1.0) is None


def test_one_process_is_the_primary_and_gathers_params_to_host():
    import jax
    from pipelinerl_jax import sharding
    assert multihost.primary_or(lambda: "real", "stand-in") == "real"  # process 0 of 1
    mesh = sharding.make_mesh((1, 2, 1))
    x = jax.device_put(np.arange(8.0).reshape(4, 2),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    host = multihost.host_params({"w": x})
    assert isinstance(host["w"], np.ndarray)
    np.testing.assert_array_equal(host["w"], np.arange(8.0).reshape(4, 2))


# ------------------------------------------------------------------ standalone roles

def test_a_standalone_role_takes_its_config_from_the_command_line(tmp_path):
    args, rest = role_main.parse_args(
        ["--role=worker", f"--workdir={tmp_path}", "--index=1",
         f"--config={ROOT}/configs/default.py:quick", "--config.transport.queue_port=7001",
         "--config.transport.weights_port=7002", "--config.transport.queue_host=localhost"])
    assert (args.role, args.index) == ("worker", 1)
    cfg = role_main.load_config(rest)
    assert cfg.transport.queue_port == 7001 and cfg.learner.total_steps == 6
    with pytest.raises(SystemExit):
        role_main.parse_args(["--role=worker", f"--workdir={tmp_path}", "--bogus=1"])

    with pytest.raises(ConfigError, match="warm_start.checkpoint: a role started on its own"):
        prepare(cfg, "worker", str(tmp_path), 1)
    init = make_init_checkpoint(str(tmp_path / "init"))
    resolved, path = prepare(cfg, "worker", str(tmp_path), 1, init)
    assert path == init and resolved.transport.vocab_size > 0  # resolved like the launcher
    assert queue_address(resolved.transport) == "localhost:7001"
    assert weights_address(resolved.transport) == "127.0.0.1:7002"
    assert json.loads((tmp_path / "config.worker1.json").read_text())["transport"][
        "queue_port"] == 7001
    assert prepare(cfg, "queue", str(tmp_path))[1] is None  # the queue needs no model

    cfg.transport.weights_port = 0
    with pytest.raises(ConfigError, match="transport.weights_port: 0 lets the launcher"):
        prepare(cfg, "queue", str(tmp_path))


def test_a_remote_queue_or_weights_host_needs_a_token_or_tls():
    cfg = run_config.base_config()
    cfg.transport.queue_host = "10.0.0.2"
    with pytest.raises(ConfigError, match="transport.queue_host: '10.0.0.2' is not a loopback"):
        run_config.validate(cfg)
    cfg.transport.auth_token = "secret"
    run_config.validate(cfg)
