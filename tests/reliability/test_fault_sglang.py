"""A pipeline run with `sampler.kind='sglang'` against a misbehaving SGLang server (the
in-repo protocol-faithful test server, stub generation): every 3rd /generate answers 503,
every 4th aborts its samples after two tokens, every 7th answers a malformed body (cut-off
JSON, a NaN log-prob, an out-of-vocabulary id, no meta_info), and for a few seconds every
answer is slower than the client's timeout. Retried, resubmitted, dropped and counted; the run
completes and trains only on whole, valid groups."""
import os

import pytest

from pipelinerl_jax.testing.sglang_process import ServerProcess
from tests.reliability.reliability_testlib import (
    events, finish, logs, max_step, read_jsonl, start_train, stop, wait_for)

pytestmark = pytest.mark.slow

TOTAL = 8


def rerouted(workdir) -> int:
    reports = read_jsonl(os.path.join(workdir, "engine_stats.jsonl"))
    return reports[-1].get("rerouted_requests", 0) if reports else 0


def test_pipeline_rides_out_a_misbehaving_sglang_server(tmp_path, init_ckpt):
    server = ServerProcess(["--stub", "--port", "0", "--model-path", init_ckpt,
                            "--fail-every", "3", "--abort-every", "4", "--corrupt-every", "7"])
    workdir = str(tmp_path / "run")
    proc = start_train(
        workdir, f"--config.warm_start.checkpoint={init_ckpt}", "--config.sampler.kind=sglang",
        f"--config.sglang.urls=('{server.url}',)", "--config.sglang.health_deadline_s=60",
        "--config.sglang.request_timeout_s=1.0", "--config.sglang.max_retries=2",
        "--config.sglang.backoff_initial_s=0.01", "--config.sglang.backoff_max_s=0.05",
        "--config.sglang.health_check_interval_s=0.2", f"--config.learner.total_steps={TOTAL}",
        "--config.learner.checkpoint_every=4")
    try:
        wait_for(lambda: max_step(workdir) >= 2, workdir, proc, what="step 2")
        # Every answer now outlasts request_timeout_s (no 503s meanwhile, so a request that
        # fails every try fails by timing out), until the server has delayed one request on
        # all its 1 + max_retries tries and the engine says it sent a request again. Not a
        # fixed few seconds: on a loaded machine they can pass with no request in flight.
        before = rerouted(workdir)  # 503s on every try reroute too
        server.configure(delay_s=1.5, fail_every=0)
        wait_for(lambda: server.stats()["most_delays_one_request"] >= 3
                 and rerouted(workdir) > before, workdir, proc, timeout=120.0,
                 what="a request timed out on every try and rerouted")
        # Every 4th answer is a server abort, but which calls those are depends on timing
        # (those during the delay reach clients that gave up): two more, to live requests.
        server.configure(delay_s=0.0, fail_every=3, abort_next=2)
        code = finish(proc, workdir)
        counts = server.stats()["counts"]
    finally:
        stop(proc)
        server.kill()
    assert code == 0, logs(workdir)
    assert counts["corrupted"] >= 1 and counts["generate"] >= 14

    # Counted by the engine and the worker (their last report in engine_stats.jsonl).
    reports = read_jsonl(os.path.join(workdir, "engine_stats.jsonl"))
    assert reports, logs(workdir)  # the worker's last report is written when its loop ends
    last = reports[-1]
    assert last["retries"] > 0                    # 503s and timeouts, retried
    assert last["server_aborted_segments"] > 0 and last["resubmitted_samples"] > 0
    assert last["rerouted_requests"] > before     # timed-out requests sent again
    failed = [e for e in events(workdir) if e["event"] == "group_failed"]
    assert failed and last["worker"]["groups_failed"] >= 1
    assert all("malformed answer" in e["reason"] or "not JSON" in e["reason"]
               for e in failed), failed
    assert any("log-prob must be a finite number" in e["reason"] for e in failed) or \
        any("not JSON" in e["reason"] for e in failed)

    # Trained: every step, on whole groups only, none of them a dropped one.
    batches = [b for b in read_jsonl(os.path.join(workdir, "batches.jsonl"))
               if b["action"] == "trained"]
    assert [b["step"] for b in batches] == list(range(1, TOTAL + 1))
    assert all(b["incomplete_groups"] == [] and b["num_groups"] == 2 for b in batches)
    dropped = {e["group_id"] for e in failed}
    assert not dropped & {g for b in batches for g in b["group_ids"]}
