"""`ServerProcess`: the test SGLang server (`sglang_server.py`) in a child process, and a client
of its test endpoints (record, configure, stats).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, List, Optional


class ServerProcess:
    """A test server in a child process: `ServerProcess(["--stub"]).url` once it listens."""

    def __init__(self, args: List[str], env: Optional[dict] = None, wait_ready: bool = True,
                 timeout_s: float = 300.0):
        import subprocess
        env = dict(os.environ if env is None else env)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["XLA_FLAGS"] = ""  # one CPU device, whatever the parent (tests fake 8) uses
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelinerl_jax.testing.sglang_server", *args],
            stdout=subprocess.PIPE, text=True, env=env)
        first = self._line(timeout_s)
        self.port, self.pid = first["port"], first["pid"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = False
        if wait_ready:
            self.wait_ready(timeout_s)

    def _line(self, timeout_s: float) -> dict:
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("l", self.proc.stdout.readline()),
                             daemon=True)
        t.start()
        t.join(timeout_s)
        if not box.get("l"):
            self.kill()
            raise RuntimeError(f"test server did not start (exit code {self.proc.poll()})")
        return json.loads(box["l"])

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        if not self.ready:
            self.ready = bool(self._line(timeout_s).get("ready"))

    def call(self, method: str, path: str, body: Any = None) -> Any:
        import urllib.request
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def record(self) -> List[dict]:
        return self.call("GET", "/_test/record")["record"]

    def configure(self, **switches) -> dict:
        return self.call("POST", "/_test/config", switches)

    def stats(self) -> dict:
        return self.call("GET", "/_test/stats")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
