"""Two hosts as two Linux network namespaces joined by a veth pair (their own interfaces,
addresses and routes; no shared loopback): host A runs the queue and the learner, bound to
its address; host B runs a rollout worker that dials A. The weights travel on the socket
payload (`transport.weight_payload='socket'`, a fixed `weight_payload_port`) with a shared
token: the run trains every step on B's groups, B receives the versions, and A's publisher
counts the payloads it sent over the link. Needs root (`ip netns`); skipped elsewhere."""
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.pipeline_testlib import (ROOT, TINY_FLAGS, make_init_checkpoint, read_jsonl,
                                    stop_process_groups, train_env)

pytestmark = [pytest.mark.slow, pytest.mark.netns]

STEPS = 4
TOKEN = "netns-shared-token"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """(address of A, address of B, namespace of A, namespace of B), torn down after."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    a, b = f"pjA{tag}", f"pjB{tag}"
    net = f"10.{77 + int(tag[:2], 16) % 100}.{int(tag[2:4], 16)}"
    if _ip("netns", "add", a, check=False).returncode != 0:
        pytest.skip("ip netns add is not permitted here")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, addr in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield f"{net}.1", f"{net}.2", a, b
    finally:
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)  # deletes the veth pair with it


def test_socket_payload_between_two_network_namespaces(tmp_path, two_hosts):
    addr_a, addr_b, ns_a, ns_b = two_hosts
    init = make_init_checkpoint(str(tmp_path / "init"), seed=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    config = [f"--config={os.path.join(ROOT, 'configs', 'default.py')}:quick", *TINY_FLAGS,
              f"--config.transport.queue_host={addr_a}",
              f"--config.transport.weights_host={addr_a}",
              "--config.transport.queue_port=50061", "--config.transport.weights_port=50062",
              "--config.transport.weight_payload=socket",
              "--config.transport.weight_payload_port=50063",
              f"--config.transport.auth_token={TOKEN}",
              f"--config.learner.total_steps={STEPS}", "--config.learner.eval_every=0",
              "--config.learner.checkpoint_every=2"]
    procs = {}

    def start(name, ns, role, workdir, *extra):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "pipelinerl_jax.launch",
               f"--role={role}", f"--workdir={workdir}", *extra, *config]
        with open(logs / f"{name}.log", "a") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           env=train_env(), cwd=ROOT, start_new_session=True)

    host_a, host_b = tmp_path / "hostA", tmp_path / "hostB"
    try:
        start("queue", ns_a, "queue", host_a / "queue")
        start("learner", ns_a, "learner", host_a / "run", f"--init_checkpoint={init}")
        start("worker", ns_b, "worker", host_b / "sampler", f"--init_checkpoint={init}")
        assert procs["learner"].wait(timeout=240) == 0, \
            (logs / "learner.log").read_text()[-3000:]
    finally:
        stop_process_groups(procs.values())

    trained = [b for b in read_jsonl(host_a / "run" / "batches.jsonl")
               if b["action"] == "trained"]
    assert [b["step"] for b in trained] == list(range(1, STEPS + 1))
    assert {g.split("-")[0] for b in trained for g in b["group_ids"]} == {"w0"}
    # B received versions over the link, and A sent them on the payload socket, not gRPC.
    received = [r["version"] for r in read_jsonl(host_b / "sampler" / "weights_received.w0.jsonl")]
    assert received and max(received) >= 1, received
    learner_log = (logs / "learner.log").read_text()
    sent = [line for line in learner_log.splitlines()
            if f"weight payload socket {addr_a}:50063:" in line]
    assert sent and " 0 payloads sent" not in sent[-1], learner_log[-3000:]
    assert TOKEN not in "".join((logs / f).read_text() for f in os.listdir(logs))
