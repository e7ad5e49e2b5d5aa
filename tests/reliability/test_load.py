"""The short version of `scripts/load_test.py` (minutes-long figures: RELIABILITY.md):
producers paced at 10x the learner's rate against the real queue server process."""
import json
import os
import subprocess
import sys

import pytest

from tests.pipeline_testlib import ROOT

pytestmark = pytest.mark.slow


def test_overload_is_bounded_pushed_back_and_loses_nothing():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "load_test.py"), "--seconds=8",
         "--producers=2", "--abandon_every=20",
         "--fill_first_s=120"],  # the timed phase starts once producers have met a full queue
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # Memory stays within the bound: held rollouts/bytes, and the server's resident memory.
    assert r["max_held_rollouts"] <= r["capacity_rollouts"]
    assert r["max_held_bytes"] <= r["capacity_bytes"]
    assert r["queue_rss_mb_max"] - r["queue_rss_mb_start"] < 64
    # Producers were pushed back (refused puts, retried by them) ...
    assert r["put_refused_full"] > 0
    assert r["producer_retries"].get("RESOURCE_EXHAUSTED", 0) == r["put_refused_full"]
    # ... and nothing was lost: every acknowledged put was stored, every stored rollout was
    # delivered (whole groups, once) or dropped with a counted reason.
    assert r["producer_server_mismatch"] == 0 and r["lost_rollouts"] == 0
    assert r["held_rollouts_end"] == 0
    assert r["partial_groups_delivered"] == 0 and r["duplicate_rollouts_delivered"] == 0
    assert r["dropped_rollouts"].get("incomplete_timeout", 0) == \
        r["groups_abandoned_half_put"] * 2  # half of each abandoned group of 4
    assert r["groups_delivered"] > 0 and r["groups_given_up"] == 0
