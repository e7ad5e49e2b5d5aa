"""A real SGLang-family server on CPU (sglang-jax, SGLang's JAX port) and the conformance checks
of `SGLangEngine` against it (`scripts/sglang_conformance.py`, `tests/rollout/test_sglang_real.py`).

sglang-jax needs Python >= 3.12 and its own dependency set, so it lives in a virtualenv outside
the repository (`ensure_venv`: built when missing, reused when present; ~4 min, ~1.8 GB);
`$PIPELINERL_SGLANG_PYTHON` names its interpreter directly. The server is launched as

    python -m sgl_jax.launch_server --model-path DIR --device cpu --attention-backend native \
        --skip-tokenizer-init --enable-deterministic-sampling --disable-overlap-schedule ...

on a tiny Qwen2 written by our `save_pretrained` (head_dim 128, no EOS so that only
`stop_token_ids` end a sample; no tokenizer files: with --skip-tokenizer-init the server reads
none). `Reference` scores completions with our own `Decoder` on the same checkpoint, which is
what the learner recomputes at lag 0.

Each check returns `Row`s: 'ok' (as SGLang's protocol says and the engine expects), 'gap'
(the server differs or lacks a feature; the engine copes or the gap is documented), 'FAIL' (the
engine's result is wrong), 'skip' (could not be observed this time, e.g. a request finished
before the pause reached it).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

PACKAGE = "sglang-jax[cpu]==0.1.0rc0"  # stable 0.0.2 cannot run on CPU
ENV_PYTHON = "PIPELINERL_SGLANG_PYTHON"
ENV_VENV = "PIPELINERL_SGLANG_VENV"
DEFAULT_VENV = os.path.expanduser("~/.cache/pipelinerl_jax/sglang-jax-venv")
VOCAB, CONTEXT = 128, 512
# Batch paddings from 2 (a padding of 1 crashes the decode precompile: ShardingTypeError),
# small token paddings (start-up ~25-80 s on 2 busy cores), a 4096-token KV pool (the default
# takes most of the free memory), and no overlap schedule: with it, 4 of 18 server lifetimes
# here decoded every batched row but the first from wrong logits (docs/sglang.md).
SERVER_ARGS = ("--device", "cpu", "--attention-backend", "native", "--skip-tokenizer-init",
               "--dtype", "float32", "--enable-deterministic-sampling", "--random-seed", "0",
               "--context-length", str(CONTEXT), "--max-running-requests", "8",
               "--max-total-tokens", "4096", "--page-size", "1",
               "--precompile-token-paddings", "64", "128", "256", "512",
               "--precompile-bs-paddings", "2", "4", "8", "--disable-overlap-schedule")
READY_LINE = "The server is fired up and ready to roll"


# ---------------------------------------------------------------------------- virtualenv

def find_base_python() -> str:
    """A working Python 3.12 to build the virtualenv with (PATH, then pyenv's versions; a
    pyenv shim without that version selected does not count)."""
    candidates = [shutil.which("python3.12")]
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")]
    try:
        roots.insert(0, subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                                       check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "versions", "3.12*", "bin",
                                                    "python3")), reverse=True)
    for c in filter(None, candidates):
        try:
            out = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.strip() == "(3, 12)":
            return c
    raise FileNotFoundError("no working Python 3.12 found (sglang-jax needs it): pass "
                            "--base-python")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def has_sglang_jax(python: str) -> bool:
    if not os.path.isfile(python):
        return False
    return subprocess.run([python, "-c", "import sgl_jax.launch_server"], env=_server_env(),
                          capture_output=True).returncode == 0


def ensure_venv(venv: str, base_python: Optional[str] = None, package: str = PACKAGE,
                log: Callable[[str], None] = print) -> str:
    """The interpreter of `venv`, after creating it and installing `package` if needed."""
    python = venv_python(venv)
    if has_sglang_jax(python):
        log(f"reusing {venv}")
        return python
    base = base_python or find_base_python()
    t0 = time.monotonic()
    log(f"building {venv} with {base}: pip install --pre '{package}' (minutes)")
    if not os.path.isfile(python):
        subprocess.run([base, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--pre", package], check=True)
    if not has_sglang_jax(python):
        raise RuntimeError(f"{venv}: sgl_jax does not import after installing {package}")
    log(f"built {venv} in {time.monotonic() - t0:.0f}s")
    return python


def server_python(venv: Optional[str] = None, base_python: Optional[str] = None,
                  log: Callable[[str], None] = print) -> str:
    """$PIPELINERL_SGLANG_PYTHON if set, else the (built or reused) virtualenv's."""
    if os.environ.get(ENV_PYTHON):
        python = os.environ[ENV_PYTHON]
        if not has_sglang_jax(python):
            raise RuntimeError(f"{ENV_PYTHON}={python} cannot import sgl_jax")
        return python
    return ensure_venv(venv or os.environ.get(ENV_VENV) or DEFAULT_VENV, base_python, log=log)


def versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json, sys; print(json.dumps({'sglang_jax': "
            "m.version('sglang-jax'), 'jax': m.version('jax'), 'python': sys.version.split()[0]}))")
    out = subprocess.run([python, "-c", code], env=_server_env(), capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _server_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")}  # nothing of ours leaks in
    env["JAX_PLATFORMS"] = "cpu"
    return env


# ---------------------------------------------------------------------------- model

def write_checkpoint(path: str, seed: int = 0):
    """A tiny Qwen2 (1.2M parameters, head_dim 128, vocabulary 128, no EOS) written with our
    `save_pretrained`; returns the `Decoder`. Weights are scaled up so that next-token
    distributions are peaked and depend on the context."""
    import jax
    from flax import nnx
    from pipelinerl_jax.models import Decoder, save_pretrained, tiny_config
    cfg = tiny_config("qwen2", vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                      max_position_embeddings=CONTEXT)
    model = Decoder(cfg, nnx.Rngs(seed))
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, nnx.state(model)))
    save_pretrained(model, path)
    return model


class Reference:
    """Our model's log-probs of completions: log softmax(logits / T) under one full forward
    of prompt + completion (the learner's recompute at lag 0)."""

    def __init__(self, model):
        import jax.numpy as jnp
        from flax import nnx
        self._jnp = jnp
        self.model = model
        self._fwd = nnx.jit(lambda m, ids: m(ids))

    def logits(self, prompt, tokens) -> np.ndarray:
        seq = np.concatenate([np.asarray(prompt), np.asarray(tokens)]).astype(np.int32)
        ids = np.zeros((1, CONTEXT), np.int32)
        ids[0, :len(seq)] = seq
        out = np.asarray(self._fwd(self.model, self._jnp.asarray(ids))[0], np.float64)
        return out[len(prompt) - 1:len(seq) - 1]

    def logprobs(self, prompt, tokens, temperature: float = 1.0) -> np.ndarray:
        z = self.logits(prompt, tokens) / (temperature if temperature > 0 else 1.0)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return logp[np.arange(len(tokens)), np.asarray(tokens)]


# ---------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RealServer:
    """One sglang-jax server process (its own process group: it forks a scheduler and a
    detokenizer, which `kill` ends with it)."""

    def __init__(self, python: str, model_path: str, log_dir: str, port: Optional[int] = None,
                 extra: Sequence[str] = (), overlap: bool = False):
        self.python, self.model_path, self.extra = python, model_path, tuple(extra)
        self.args = tuple(a for a in SERVER_ARGS
                          if not (overlap and a == "--disable-overlap-schedule"))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"sglang-jax-{self.port}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: List[float] = []

    def start(self, timeout_s: float = 400.0) -> "RealServer":
        t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "sgl_jax.launch_server", "--model-path", self.model_path,
                 "--host", "127.0.0.1", "--port", str(self.port), *self.args, *self.extra],
                stdout=log, stderr=subprocess.STDOUT, env=_server_env(), start_new_session=True)
        # /health answers 200 before the warm-up request is done; a request mixing into it
        # can crash this version (see docs/sglang.md), so the log's ready line is awaited too.
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-jax on port {self.port} exited with "
                                   f"{self.proc.returncode}:\n{self.log_tail()}")
            if READY_LINE in self.log_tail(200_000) and http_call(self.url, "GET", "/health")[0] == 200:
                self.startup_s.append(time.monotonic() - t0)
                return self
            time.sleep(1.0)
        self.kill()
        raise TimeoutError(f"sglang-jax on port {self.port} not ready in {timeout_s}s:\n"
                           f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL to the server's process group (only processes it started)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc = None
        # The ready line of this run must not satisfy the next start's wait.
        with open(self.log_path, "a") as f:
            f.write("\n--- killed ---\n")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        return text.rsplit("--- killed ---", 1)[-1][-chars:]


def http_call(url: str, method: str, path: str, body: Any = None, timeout: float = 120.0):
    """(status, decoded JSON or text) of one request; (0, message) when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except OSError as e:
        return 0, str(e)
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


# ---------------------------------------------------------------------------- checks

@dataclasses.dataclass
class Row:
    name: str
    expected: str
    observed: str
    verdict: str  # ok | gap | FAIL | skip


ENGINE_CFG = dict(health_deadline_s=120.0, health_check_interval_s=1.0, max_retries=2,
                  backoff_initial_s=0.05, backoff_max_s=0.5, request_timeout_s=300.0,
                  control_timeout_s=60.0, concurrency_per_server=8)
PROMPT = np.asarray([1, 5, 6, 7, 8], np.int32)
LOGP_TOL = 2e-3  # |server log-prob - ours|, float32 on both sides


def request(rid, max_new, n=1, seed=None, temperature=1.0, stop=(), prompt=PROMPT):
    from pipelinerl_jax.types import GenerationRequest, SamplingParams
    return GenerationRequest(rid, np.asarray(prompt, np.int32), SamplingParams(
        max_new_tokens=max_new, n=n, seed=seed, temperature=temperature,
        stop_token_ids=tuple(stop)))


def collect(eng, n: int, timeout: float = 120.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += eng.get_completions(timeout=0.2)
    if len(got) < n:
        raise TimeoutError(f"{len(got)} of {n} samples finished in {timeout}s")
    return sorted(got, key=lambda c: (c.request_id, c.sample_index))


class Conformance:
    """The checks; `rows` accumulates their results, `max_logp_diff` the largest
    |behaviour log-prob - ours| seen."""

    def __init__(self, reference: Reference, log: Callable[[str], None] = print):
        self.ref, self.log = reference, log
        self.rows: List[Row] = []
        self.max_logp_diff = 0.0
        self._seq = 0

    def add(self, name, expected, observed, verdict) -> Row:
        row = Row(name, expected, observed, verdict)
        self.rows.append(row)
        self.log(f"[{verdict:>4}] {name}: {observed}")
        return row

    def run(self, name: str, fn, *args) -> None:
        """`fn(*args)`; an exception is a FAIL row naming it (the other checks go on)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a broken check must not hide the others
            self.add(name, "(check ran)", f"{type(e).__name__}: {str(e)[:300]}", "FAIL")

    def engine(self, urls, version=0, **cfg):
        from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
        return SGLangEngine(list(urls), dict(ENGINE_CFG, **cfg), vocab_size=VOCAB,
                            max_seq_len=CONTEXT, version=version)

    def rid(self, tag: str) -> str:
        self._seq += 1
        return f"{tag}-{self._seq}"

    def logp_diff(self, completions, temperature=1.0) -> float:
        """max |behaviour log-prob - ours| over `completions`; where they differ is logged."""
        worst = 0.0
        for c in completions:
            if len(c.token_ids):
                d = np.abs(self.ref.logprobs(c.prompt_ids, c.token_ids, temperature)
                           - c.logp_behaviour)
                worst = max(worst, float(d.max()))
                bad = np.nonzero(d >= LOGP_TOL)[0]
                if len(bad):
                    self.log(f"  {c.request_id}[{c.sample_index}]: {len(bad)} of "
                             f"{len(d)} log-probs differ from ours, first at {bad[:5].tolist()}")
        self.max_logp_diff = max(self.max_logp_diff, worst)
        return worst

    # ------------------------------------------------------------------ server surface

    def check_endpoints(self, url: str) -> None:
        from pipelinerl_jax.rollout.sglang_client import (REFIT_ENDPOINTS, ServerClient,
                                                          missing_endpoints)
        client = ServerClient(url)
        missing = missing_endpoints(client, REFIT_ENDPOINTS + ("/abort_request", "/flush_cache"))
        client.close()
        needed = [p for p in missing if p != "/update_weights_from_disk"]
        self.add("endpoints", "pause, update_weights_from_disk, continue, abort, flush",
                 f"missing: {', '.join(missing) or 'none'}",
                 "FAIL" if needed else "gap" if missing else "ok")
        status, info = http_call(url, "GET", "/get_model_info")
        has = isinstance(info, dict) and "weight_version" in info
        self.add("weight_version label", "/get_model_info has weight_version",
                 f"HTTP {status}, weight_version {'present' if has else 'absent'}",
                 "ok" if has else "gap")

    def check_refit_probe(self, url: str) -> None:
        from pipelinerl_jax.rollout.sglang_client import MissingEndpointError
        from pipelinerl_jax.rollout.sglang_engine import SGLangEngine
        try:
            eng = SGLangEngine([url], ENGINE_CFG, vocab_size=VOCAB, max_seq_len=CONTEXT,
                               require_refit=True)
        except MissingEndpointError as e:
            named = url in str(e) and "/update_weights_from_disk" in str(e)
            self.add("refit config fails at start-up", "MissingEndpointError naming server "
                     "and endpoint", str(e).split(" (HTTP")[0][-90:], "ok" if named else "FAIL")
            return
        eng.close()
        self.add("refit config fails at start-up", "(server has the endpoint)", "probe passed",
                 "ok")

    def check_resent_logprobs(self, url: str) -> None:
        status, a = http_call(url, "POST", "/generate", {
            "input_ids": PROMPT.tolist(), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 120, "temperature": 1.0}})
        meta = a["meta_info"]
        n, c = len(meta["output_token_logprobs"]), meta["completion_tokens"]
        self.add("raw output_token_logprobs", "completion_tokens entries",
                 f"{n} entries for {c} tokens (prefixes resent at every 50th)",
                 "ok" if n == c else "gap")

    # ------------------------------------------------------------------ generation

    def check_generation(self, url: str) -> None:
        with self.engine([url]) as eng:
            seeded = eng.generate([request(self.rid("seeded"), 120, n=4, seed=11)], timeout=300)
            again = eng.generate([request(self.rid("again"), 120, n=4, seed=11)], timeout=300)
            par = eng.generate([request(self.rid("par"), 60, n=3)], timeout=300)
            cool = eng.generate([request(self.rid("t07"), 40, n=2, seed=5, temperature=0.7)],
                                timeout=300)
            greedy = eng.generate([request(self.rid("greedy"), 40, temperature=0.0)],
                                  timeout=300)[0]
            st = eng.stats()
        shapes = all(len(c.token_ids) == 120 and c.finish_reason == "length" for c in seeded)
        distinct = len({tuple(c.token_ids) for c in seeded})
        d = self.logp_diff(seeded + again + par)
        self.add("generate n=4 seeded (>50 tokens)", "4 x 120 tokens, log-probs = ours",
                 f"{len(seeded)} x {[len(c.token_ids) for c in seeded]}, {distinct} distinct, "
                 f"max |dlogp| {d:.1e}, request errors {st['request_errors']}",
                 "ok" if shapes and d < LOGP_TOL and st["request_errors"] == 0 else "FAIL")
        same = [bool(np.array_equal(a.token_ids, b.token_ids)) for a, b in zip(seeded, again)]
        self.add("seeds reproduce", "same seed -> same samples",
                 f"per sample {same} (batched copies of one prompt share a prefill)",
                 "ok" if all(same) else "gap" if same[0] else "FAIL")
        ndist = len({tuple(c.token_ids) for c in par})
        self.add("n=3 without seed", "3 different samples",
                 f"{ndist} distinct of {len(par)} (--enable-deterministic-sampling gives every "
                 "unseeded request the same default seed)" if ndist < 3 else f"{ndist} distinct",
                 "ok" if ndist == 3 else "gap")
        d07 = self.logp_diff(cool, 0.7)
        self.add("temperature 0.7 log-probs", "log softmax(logits / 0.7)", f"max |dlogp| {d07:.1e}",
                 "ok" if d07 < LOGP_TOL else "FAIL")
        arg = self.ref.logits(greedy.prompt_ids, greedy.token_ids).argmax(-1)
        dg = self.logp_diff([greedy], 1.0)
        ok = np.array_equal(arg, greedy.token_ids) and dg < LOGP_TOL
        self.add("greedy (T=0)", "our argmax; log-probs at T=1",
                 f"argmax match {np.array_equal(arg, greedy.token_ids)}, max |dlogp| {dg:.1e}",
                 "ok" if ok else "FAIL")
        self.greedy = greedy
        versions = {int(v) for c in seeded + par for v in c.version}
        self.add("token versions", "the engine's version (0) on every token",
                 f"versions {sorted(versions)}, inexact {st['inexact_provenance_samples']}",
                 "ok" if versions == {0} and not st["inexact_provenance_samples"] else "FAIL")

    def check_stress(self, url: str, rounds: int = 8) -> None:
        """Batched decoding, repeated: per round two seeded n=4 requests, the second sent a
        little later each round so that its prefill joins the first one's running decode at
        varying points; every sample must equal our log-probs and round 0's tokens."""
        first, differ, irreproducible, total = {}, 0, 0, 0
        with self.engine([url]) as eng:
            for r in range(rounds):
                for k in range(2):
                    eng.submit(request(self.rid(f"stress{k}"), 60, n=4, seed=31 + k))
                    time.sleep(0.03 * r * (k == 0))
                for c in collect(eng, 8, 300):
                    key = (c.request_id.split("-")[0], c.sample_index)
                    total += 1
                    differ += self.logp_diff([c]) >= LOGP_TOL
                    if key in first:
                        irreproducible += not np.array_equal(first[key], c.token_ids)
                    first.setdefault(key, c.token_ids)
        self.add(f"batched decode x{rounds} rounds", "every sample = our log-probs, "
                 "same seed -> same tokens",
                 f"{differ} of {total} samples differ from our log-probs, "
                 f"{irreproducible} of {total - 8} not reproduced",
                 "ok" if differ == 0 and irreproducible == 0 else "FAIL")

    def check_stop(self, url: str) -> None:
        toks = self.greedy.token_ids.tolist()
        k = next((i for i in range(3, len(toks)) if toks[i] not in toks[:i]), None)
        if k is None:
            self.add("stop token", "ends at the stop token", "no fresh token in the greedy run",
                     "skip")
            return
        with self.engine([url]) as eng:
            c = eng.generate([request(self.rid("stop"), 40, temperature=0.0, stop=(toks[k],))],
                             timeout=300)[0]
        ok = c.finish_reason == "stop" and c.token_ids.tolist() == toks[:k + 1]
        self.add("stop token", f"finish 'stop' after {k + 1} tokens, stop token kept",
                 f"finish {c.finish_reason!r}, {len(c.token_ids)} tokens", "ok" if ok else "FAIL")

    # ------------------------------------------------------------------ pause / abort

    def check_pause(self, url: str, mode: str) -> None:
        """A seeded sample paused mid-generation and resumed equals the unpaused one ('abort':
        the server aborts it, the engine resubmits prompt + tokens so far)."""
        max_new = 450
        with self.engine([url], pause_mode=mode) as eng:
            ref = eng.generate([request(self.rid("unpaused"), max_new, seed=21)], timeout=300)[0]
            eng.submit(request(self.rid(f"pause-{mode}"), max_new, seed=21))
            time.sleep(0.4)
            if mode == "abort":  # what a refit with pause_mode='abort' does on the server
                status, _ = http_call(url, "POST", "/pause_generation", {"mode": "abort"})
            else:
                eng.pause()
            time.sleep(1.5)
            early = eng.get_completions(timeout=0.0)
            flush, _ = http_call(url, "POST", "/flush_cache", {})
            if mode == "abort":
                http_call(url, "POST", "/continue_generation", {})
            else:
                eng.resume()
            out = early or collect(eng, 1, 300)
            st = eng.stats()
        c = out[0]
        d = self.logp_diff([c])
        same = np.array_equal(c.token_ids, ref.token_ids)
        extra = f", resubmitted {st['resubmitted_samples']}" if mode == "abort" else ""
        if early and early[0].finish_reason != "abort":
            self.add(f"pause {mode}", "request held, then finishes as if unpaused",
                     "finished before the pause reached it", "skip")
            return
        self.add(f"pause {mode}", "request held, then equal to the unpaused sample",
                 f"{len(c.token_ids)} tokens, equal {same}, max |dlogp| {d:.1e}, flush while "
                 f"paused -> HTTP {flush}{extra}",
                 "ok" if same and d < LOGP_TOL and c.finish_reason == "length" else "FAIL")

    def check_client_abort(self, url: str, seeded: bool) -> None:
        """engine.abort of an n=3 request: every sample must stop early."""
        form = "batched (seeded)" if seeded else "parallel (n, no seed)"
        with self.engine([url]) as eng:
            rid = self.rid("abort")
            eng.submit(request(rid, 450, n=3, seed=3 if seeded else None))
            time.sleep(0.5)
            t0 = time.monotonic()
            eng.abort(rid)
            out = collect(eng, 3, 300)
            dt = time.monotonic() - t0
        lengths = [len(c.token_ids) for c in out]
        reasons = sorted({c.finish_reason for c in out})
        stopped = all(c.finish_reason == "abort" and len(c.token_ids) < 450 for c in out)
        self.add(f"client abort n=3 {form}", "all 3 stop early ('abort')",
                 f"{reasons}, lengths {lengths}, {dt:.1f}s after abort",
                 "ok" if stopped else "FAIL")

    def check_abort_rids(self, url: str) -> None:
        """Which rids /abort_request matches: exact, prefix, parent of parallel children."""
        def run(body, abort_rid, delay=0.4):
            box = []
            t = threading.Thread(target=lambda: box.append(http_call(url, "POST", "/generate",
                                                                     body, 300)))
            t.start()
            time.sleep(delay)
            http_call(url, "POST", "/abort_request", {"rid": abort_rid, "abort_all": False})
            t.join()
            items = box[0][1]
            items = items if isinstance(items, list) else [items]
            return [(it["meta_info"]["id"], it["meta_info"]["finish_reason"]["type"])
                    for it in items]
        sp = {"max_new_tokens": 450, "temperature": 1.0}
        base = self.rid("raw")
        exact = run({"input_ids": [PROMPT.tolist()] * 2, "rid": [f"{base}/0", f"{base}/1"],
                     "sampling_params": sp, "return_logprob": True}, f"{base}/0")
        prefix = run({"input_ids": [PROMPT.tolist()] * 2, "rid": [f"{base}p/0", f"{base}p/1"],
                      "sampling_params": sp, "return_logprob": True}, f"{base}p/")
        parent = run({"input_ids": PROMPT.tolist(), "rid": f"{base}n",
                      "sampling_params": dict(sp, n=2), "return_logprob": True}, f"{base}n")
        kinds = lambda r: [k for _, k in r]
        self.add("abort by exact rid", "that request aborted", f"{kinds(exact)}",
                 "ok" if kinds(exact) == ["abort", "length"] else "gap")
        self.add("abort by rid prefix", "SGLang scheduler: prefix match",
                 f"{kinds(prefix)} (the tokenizer manager drops rids it does not hold exactly)",
                 "ok" if kinds(prefix) == ["abort", "abort"] else "gap")
        fresh = all(i != f"{base}n" and not i.startswith(f"{base}n") for i, _ in parent)
        self.add("abort parallel n=2 by parent rid", "children aborted",
                 f"{kinds(parent)}; children's meta_info.id are "
                 f"{'fresh uuids' if fresh else 'derived from the parent'}",
                 "ok" if kinds(parent) == ["abort", "abort"] else "gap")

    def check_flush(self, url: str) -> None:
        idle, _ = http_call(url, "POST", "/flush_cache", {})
        box = []
        t = threading.Thread(target=lambda: box.append(http_call(url, "POST", "/generate", {
            "input_ids": PROMPT.tolist(), "return_logprob": True,  # never mix without (crash)
            "sampling_params": {"max_new_tokens": 300}}, 300)))
        t.start()
        time.sleep(0.4)
        busy, _ = http_call(url, "POST", "/flush_cache", {})
        t.join()
        self.add("flush_cache", "200 idle; refused while requests run (as SGLang)",
                 f"idle HTTP {idle}, busy HTTP {busy}",
                 "ok" if idle == 200 and busy == 400 else "gap")

    # ------------------------------------------------------------------ two servers

    def check_reroute(self, a: RealServer, b: RealServer) -> None:
        """Kill server b mid-run: its requests finish on a; b restarted is re-admitted."""
        with self.engine([a.url, b.url]) as eng:
            rids = [self.rid("route") for _ in range(6)]
            for i, rid in enumerate(rids):
                eng.submit(request(rid, 300, n=2, seed=100 + i))
            deadline = time.monotonic() + 30
            while eng.stats()["servers"][1]["in_flight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            on_b = eng.stats()["servers"][1]["in_flight"]
            b.kill()
            out = collect(eng, 12, 300)
            st = eng.stats()
            full = all(len(c.token_ids) == 300 and c.finish_reason == "length" for c in out)
            d = self.logp_diff(out)
            self.add("kill 1 of 2 servers mid-run", "its requests rerouted, all complete",
                     f"{on_b} samples were on it; {len(out)}/12 complete, rerouted "
                     f"{st['rerouted_requests']}, down {len(st['servers_down'])}, "
                     f"max |dlogp| {d:.1e}",
                     "ok" if full and st["rerouted_requests"] >= 1 and d < LOGP_TOL
                     else "FAIL")
            b.start()
            deadline = time.monotonic() + 60
            while b.url not in eng.health()["servers_up"] and time.monotonic() < deadline:
                time.sleep(0.5)
            back = b.url in eng.health()["servers_up"]
            before = eng.stats()["servers"][1]["requests"]
            eng.generate([request(self.rid("back"), 20, n=2, seed=i) for i in range(8)],
                         timeout=300)
            used = eng.stats()["servers"][1]["requests"] - before
        self.add("restarted server re-admitted", "back in routing, serves again",
                 f"re-admitted {back} (start-up {b.startup_s[-1]:.0f}s), {used} requests after",
                 "ok" if back and used > 0 else "FAIL")
