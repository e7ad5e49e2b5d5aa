"""Two runs with the same seeds under lag injection are identical bit for bit (every metric
except timings, every sample, every parameter), the second one with the transport secured
through the pipeline config (different timing, same numbers): a
shared token (`transport.auth_token_file`) and TLS (`transport.tls_*`, a self-signed pair made
here). While it trains, calls without the token get UNAUTHENTICATED on both services and a
plaintext client gets nowhere."""
import math
import os

import grpc
import numpy as np
import pytest

from pipelinerl_jax.transport import rollout_pb2 as pb
from pipelinerl_jax.transport.queue_server import SERVICE as QUEUE
from pipelinerl_jax.transport.weights import SUBSCRIBE
from tests.reliability.reliability_testlib import (
    checkpoint_state, finish, logs, max_step, read_jsonl, run_config, start_train, stop, wait_for)
from tests.transport.transport_testlib import self_signed_pair

pytestmark = pytest.mark.slow

# A truncated answer earns -1 and one ended by EOS 0, so groups of the random tiny model
# have reward variance and the runs really train (with every reward 0 the loss is 0, the
# parameters never move, and "identical" would prove nothing). Six groups a step: a worker
# handing them to the engine one at a time (the code before `submit_batch`) let the engine's
# loop start on the first few, and the runs differed in the last bits.
FLAGS = ("--config.lag_injection.enabled=True", "--config.lag_injection.k=1",
         "--config.learner.total_steps=4", "--config.learner.checkpoint_every=2",
         "--config.seed=5", "--config.task.truncated_reward=-1.0",
         "--config.sampling.max_new_tokens=20", "--config.learner.batch_groups=6")
# Wall-clock measurements: the only values two identical runs may disagree on.
TIMING = ("wall_time_s", "learner/step_time_s", "learner/wait_time_s", "learner/tokens_per_s",
          "weight_sync/time_s", "weight_sync/background_s", "sampler/occupancy",
          "sampler/tokens_per_s", "time_unix")


def _probe(workdir, cert):
    """Calls the run's services the way an intruder would; returns the status codes."""
    t = run_config(workdir)["transport"]
    creds = grpc.ssl_channel_credentials(open(cert, "rb").read())
    opts = [("grpc.ssl_target_name_override", "localhost")]
    out = {}
    for name, port, method, request in (
            ("queue", t["queue_port"], f"/{QUEUE}/GetStats", pb.StatsRequest()),
            ("weights", t["weights_port"], SUBSCRIBE, pb.SubscribeRequest(have_version=-1))):
        address = f"{t['host']}:{port}"
        for how, channel, md in (
                ("no token", grpc.secure_channel(address, creds, opts), ()),
                ("wrong token", grpc.secure_channel(address, creds, opts),
                 (("authorization", "Bearer guess"),)),
                ("plaintext", grpc.insecure_channel(address),
                 (("authorization", f"Bearer {open(t['auth_token_file']).read().strip()}"),))):
            call = channel.unary_unary(method, request_serializer=type(request).SerializeToString)
            if name == "weights":
                call = channel.unary_stream(method,
                                            request_serializer=type(request).SerializeToString)
            try:
                result = call(request, timeout=5, metadata=md)
                if name == "weights":
                    next(iter(result))
                out[(name, how)] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                out[(name, how)] = e.code()
            channel.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, init_ckpt):
    root = tmp_path_factory.mktemp("determinism")
    plain = str(root / "plain")
    proc = start_train(plain, f"--config.warm_start.checkpoint={init_ckpt}", *FLAGS)
    try:
        assert finish(proc, plain) == 0, logs(plain)
    finally:
        stop(proc)
    cert, key = self_signed_pair(str(root))
    token = root / "token"
    token.write_text("a-long-random-shared-secret\n")
    secured = str(root / "secured")
    proc = start_train(secured, f"--config.warm_start.checkpoint={init_ckpt}", *FLAGS,
                       f"--config.transport.auth_token_file={token}",
                       f"--config.transport.tls_cert_file={cert}",
                       f"--config.transport.tls_key_file={key}",
                       f"--config.transport.tls_ca_file={cert}",
                       "--config.transport.tls_server_name=localhost")
    try:
        wait_for(lambda: max_step(secured) >= 1, secured, proc, what="step 1")
        probes = _probe(secured, cert)
        assert finish(proc, secured) == 0, logs(secured)
    finally:
        stop(proc)
    return plain, secured, probes


def _metrics(workdir):
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


# What a sample line holds besides timings (`time_s`, `gen_time_s`, `queue_time_s`).
SAMPLE_TIMING = ("time_s", "gen_time_s", "queue_time_s")


def test_same_seeds_under_lag_injection_give_identical_metrics(runs):
    plain, secured, _ = runs
    a, b = _metrics(plain), _metrics(secured)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:  # exact: the same float, bit for bit (NaN only where the other is NaN)
            same = ra[k] == rb[k] or (isinstance(ra[k], float) and math.isnan(ra[k])
                                      and math.isnan(rb[k]))
            assert same, f"step {ra['step']}: {k} = {ra[k]!r} vs {rb[k]!r}"
    # Not vacuous: the runs trained (the loss moved) and every token had lag exactly 1.
    assert any(r["loss/loss"] != 0.0 for r in a[1:])
    assert all(r["lag/mean"] == 1.0 for r in a[1:])
    # The data too: the same group ids trained at the same steps, the same samples (lengths,
    # rewards, finish reasons) in the same order; and the parameters, bit for bit.
    ga = [b["group_ids"] for b in read_jsonl(os.path.join(plain, "batches.jsonl"))]
    gb = [b["group_ids"] for b in read_jsonl(os.path.join(secured, "batches.jsonl"))]
    assert ga == gb
    sa, sb = (_samples(plain), _samples(secured))
    assert len(sa) >= 4 * 6 * 2 and sa == sb
    initial, final_a, final_b = (checkpoint_state(plain, 2), checkpoint_state(plain, 4),
                                 checkpoint_state(secured, 4))
    assert any(not np.array_equal(x, y) for x, y in zip(initial, final_a))
    for x, y in zip(final_a, final_b):
        np.testing.assert_array_equal(x, y)


def _samples(workdir):
    return [{k: v for k, v in r.items() if k not in SAMPLE_TIMING}
            for r in read_jsonl(os.path.join(workdir, "samples.w0.jsonl"))]


def test_secured_pipeline_refuses_calls_without_the_token(runs):
    _, secured, probes = runs
    for service in ("queue", "weights"):
        assert probes[(service, "no token")] == grpc.StatusCode.UNAUTHENTICATED
        assert probes[(service, "wrong token")] == grpc.StatusCode.UNAUTHENTICATED
        assert probes[(service, "plaintext")] == grpc.StatusCode.UNAVAILABLE  # TLS only
    cfg = run_config(secured)["transport"]
    assert cfg["host"] == "127.0.0.1" and cfg["auth_token"] is None  # the secret stays in its file
