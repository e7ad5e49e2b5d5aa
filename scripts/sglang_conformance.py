"""Conformance of `SGLangEngine` against real SGLang-family servers: sglang-jax on CPU.

    PYTHONPATH=. python scripts/sglang_conformance.py [--venv DIR] [--base-python PY3.12]
        [--workdir DIR] [--no-reroute] [--overlap] [--server-arg=--flag ...]

Builds (first run, ~4 min, ~1.8 GB) or reuses a Python 3.12 virtualenv with sglang-jax outside
the repository (`--venv`, else $PIPELINERL_SGLANG_VENV, else ~/.cache/pipelinerl_jax/
sglang-jax-venv; $PIPELINERL_SGLANG_PYTHON names an interpreter to use as is), writes a tiny
Qwen2 with our `save_pretrained`, starts a server on 127.0.0.1 and runs the engine against it:
generation with n > 1 and seeds, behaviour log-probs against our own model's recompute on the
same checkpoint, stop tokens, pause in_place / retract / abort, client abort of n > 1 requests,
which rids /abort_request matches, flush, then a second server that is killed mid-run (the
engine reroutes) and restarted (re-admitted). One server at a time except for that last check.
Prints a table (ok: as SGLang's protocol says; gap: the server lacks or changes something, the
engine copes or it is documented; FAIL: the engine's result is wrong; skip: not observable this
run) and ends with one JSON line. Servers run with --disable-overlap-schedule unless --overlap
(sglang-jax's default, which corrupted batched decoding in some server lifetimes here: the
'batched decode' check shows it). Servers are killed at the end, also on failure or Ctrl-C.
Exit status 1 if any check FAILs.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pipelinerl_jax.testing import sglang_jax as sj  # noqa: E402
from pipelinerl_jax.testing import sglang_jax_checks as checks  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=None, help="virtualenv with sglang-jax (built if missing)")
    p.add_argument("--base-python", default=None, help="Python 3.12 to build it with")
    p.add_argument("--workdir", default=None, help="checkpoint and server logs (default: tmp)")
    p.add_argument("--no-reroute", action="store_true", help="skip the two-server check")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra launch_server argument (repeatable), e.g. "
                        "--server-arg=--disable-radix-cache")
    p.add_argument("--overlap", action="store_true",
                   help="keep sglang-jax's overlap schedule (default: --disable-overlap-schedule)")
    p.add_argument("--stress-rounds", type=int, default=8)
    args = p.parse_args(argv)
    t_start = time.monotonic()
    workdir = args.workdir or tempfile.mkdtemp(prefix="sglang-conformance-")
    os.makedirs(workdir, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    python = sj.server_python(args.venv, args.base_python, log=log)
    vers = sj.versions(python)
    log(f"server interpreter {python}: {vers}; workdir {workdir}")
    ckpt = os.path.join(workdir, "tiny-qwen2")
    model = sj.write_checkpoint(ckpt)
    conf = checks.Conformance(sj.Reference(model), log=log)

    servers = []

    def stop_all(*_):
        for s in servers:
            s.kill()
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # runs atexit: servers killed
    try:
        a = sj.RealServer(python, ckpt, workdir, extra=args.server_arg, overlap=args.overlap)
        servers.append(a)
        a.start()
        log(f"server A {a.url} ready in {a.startup_s[-1]:.0f}s")
        conf.run("endpoints", conf.check_endpoints, a.url)
        conf.run("refit probe", conf.check_refit_probe, a.url)
        conf.run("resent log-probs", conf.check_resent_logprobs, a.url)
        conf.run("generation", conf.check_generation, a.url)
        conf.run("stop token", conf.check_stop, a.url)
        conf.run("batched decode", conf.check_stress, a.url, args.stress_rounds)
        for mode in ("in_place", "retract", "abort"):
            conf.run(f"pause {mode}", conf.check_pause, a.url, mode)
        conf.run("client abort batched", conf.check_client_abort, a.url, True)
        conf.run("client abort parallel", conf.check_client_abort, a.url, False)
        conf.run("abort rids", conf.check_abort_rids, a.url)
        conf.run("flush", conf.check_flush, a.url)
        if not args.no_reroute:
            if not a.alive():  # a crash above (see its log) must not fail the next check
                log(f"server A died; restarting it:\n{a.log_tail(1500)}")
                a.start()
            b = sj.RealServer(python, ckpt, workdir, extra=args.server_arg, overlap=args.overlap)
            servers.append(b)
            b.start()
            log(f"server B {b.url} ready in {b.startup_s[-1]:.0f}s")
            conf.run("reroute", conf.check_reroute, a, b)
        crashed = [s.url for s in servers if s.proc is not None and not s.alive()]
        if crashed:
            conf.add("servers alive at the end", "no crash", f"crashed: {crashed}", "FAIL")
    finally:
        stop_all()

    width = max(len(r.name) for r in conf.rows)
    print(f"\n{'check':<{width}}  verdict  observed  [expected]")
    for r in conf.rows:
        print(f"{r.name:<{width}}  {r.verdict:<7}  {r.observed}  [{r.expected}]")
    counts = {v: sum(r.verdict == v for r in conf.rows) for v in ("ok", "gap", "FAIL", "skip")}
    result = {"passed": counts["FAIL"] == 0, **counts, **vers,
              "server_args": list(servers[0].args + servers[0].extra),
              "max_logprob_abs_diff": conf.max_logp_diff, "logprob_tol": checks.LOGP_TOL,
              "startup_s": [round(t, 1) for s in servers for t in s.startup_s],
              "wall_s": round(time.monotonic() - t_start, 1),
              "checks": {r.name: r.verdict for r in conf.rows}}
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
