"""A real SGLang-family server on CPU (sglang-jax, SGLang's JAX port): its virtualenv, the
server process, a tiny checkpoint and our own reference scores. The conformance checks of
`SGLangEngine` against it are in `sglang_jax_checks.py`.

sglang-jax needs Python >= 3.12 and its own dependency set, so it lives in a virtualenv outside
the repository (`ensure_venv`: built when missing, reused when present; ~4 min, ~1.8 GB);
`$PIPELINERL_SGLANG_PYTHON` names its interpreter directly. The server is launched as

    python -m sgl_jax.launch_server --model-path DIR --device cpu --attention-backend native \
        --skip-tokenizer-init --enable-deterministic-sampling --disable-overlap-schedule ...

on a tiny Qwen2 written by our `save_pretrained` (head_dim 128, no EOS so that only
`stop_token_ids` end a sample; no tokenizer files: with --skip-tokenizer-init the server reads
none). `Reference` scores completions with our own `Decoder` on the same checkpoint, which is
what the learner recomputes at lag 0.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
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
