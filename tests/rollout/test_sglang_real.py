"""`SGLangEngine` against real sglang-jax servers on CPU (marker `sglang_real`): the checks of
`scripts/sglang_conformance.py` as tests. Skipped unless $PIPELINERL_SGLANG_PYTHON names a
Python with sglang-jax (the script builds one: ~/.cache/pipelinerl_jax/sglang-jax-venv/bin/python
by default); never part of the default suite otherwise.

    PIPELINERL_SGLANG_PYTHON=/path/to/venv/bin/python python -m pytest -q -m sglang_real \
        tests/rollout/test_sglang_real.py
"""
import os

import pytest

from pipelinerl_jax.testing import sglang_jax as sj
from pipelinerl_jax.testing import sglang_jax_checks as checks

pytestmark = [pytest.mark.sglang_real,
              pytest.mark.skipif(not os.environ.get(sj.ENV_PYTHON),
                                 reason=f"${sj.ENV_PYTHON} (a Python with sglang-jax) is not set")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-jax")
    ckpt = str(root / "tiny-qwen2")
    conf = checks.Conformance(sj.Reference(sj.write_checkpoint(ckpt)))
    python = sj.server_python()
    servers = [sj.RealServer(python, ckpt, str(root))]
    try:
        servers[0].start()
        yield conf, servers, python, ckpt, str(root)
    finally:
        for s in servers:
            s.kill()


def rows_of(conf, fn, *args):
    n = len(conf.rows)
    fn(*args)
    return conf.rows[n:]


def assert_conforms(rows):
    failed = [r for r in rows if r.verdict == "FAIL"]
    assert not failed, "; ".join(f"{r.name}: {r.observed} (expected {r.expected})"
                                 for r in failed)


def test_surface_and_refit_probe(setup):
    conf, (a, *_), *_ = setup
    rows = rows_of(conf, conf.check_endpoints, a.url) + rows_of(conf, conf.check_refit_probe,
                                                                 a.url)
    rows += rows_of(conf, conf.check_resent_logprobs, a.url)
    assert_conforms(rows)
    assert {r.name: r.verdict for r in rows}["refit config fails at start-up"] == "ok"


def test_generation_matches_our_model(setup):
    conf, (a, *_), *_ = setup
    rows = rows_of(conf, conf.check_generation, a.url) + rows_of(conf, conf.check_stop, a.url)
    rows += rows_of(conf, conf.check_stress, a.url, 3)
    assert_conforms(rows)
    assert conf.max_logp_diff < checks.LOGP_TOL


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_and_resume(setup, mode):
    conf, (a, *_), *_ = setup
    assert_conforms(rows_of(conf, conf.check_pause, a.url, mode))


def test_client_abort_of_a_seeded_group(setup):
    conf, (a, *_), *_ = setup
    assert_conforms(rows_of(conf, conf.check_client_abort, a.url, True))
    assert_conforms(rows_of(conf, conf.check_abort_rids, a.url) +
                    rows_of(conf, conf.check_flush, a.url))


def test_client_abort_of_an_unseeded_group(setup):
    conf, (a, *_), *_ = setup
    assert_conforms(rows_of(conf, conf.check_client_abort, a.url, False))


def test_kill_and_restart_one_of_two_servers(setup):
    conf, servers, python, ckpt, root = setup
    b = sj.RealServer(python, ckpt, root)
    servers.append(b)
    b.start()
    assert_conforms(rows_of(conf, conf.check_reroute, servers[0], b))
