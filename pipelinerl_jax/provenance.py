"""Where a run ran: library versions, CPU model, code version and machine.

    provenance()  ->  {"jax": "0.10.2", "jaxlib": ..., "flax": ..., "optax": ...,
                       "cpu_model": "...", "git_sha": "e9db6b4...", "machine_id": "..."}

A same-seed rerun is bit-identical on one machine with one install, and not across machines
(docs/staleness_study.md, Reproducibility): a run's result is a sample of (config, seed,
machine, libraries, code). The ablation runner records this in every run's `status.json`,
`results.summarize_run` carries it into runs.csv, and the study's report flags cells whose
runs disagree on it. A value that cannot be read is "unknown"; tables written before this
existed read as "unrecorded" (`results.PROVENANCE_UNRECORDED`), never as a guess.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from importlib import metadata

LIBRARIES = ("jax", "jaxlib", "flax", "optax")
FIELDS = LIBRARIES + ("cpu_model", "git_sha", "machine_id")
UNKNOWN = "unknown"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def library_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or UNKNOWN


def git_sha(root: str = ROOT) -> str:
    """HEAD of the checkout holding the code, with '-dirty' when tracked files differ."""
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not sha:
            return UNKNOWN
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN


def machine_id() -> str:
    """A stable, non-identifying id of this machine: a hash of /etc/machine-id (or of the
    host name where there is none)."""
    raw = ""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw:
            break
    raw = raw or platform.node()
    return hashlib.sha256(raw.encode()).hexdigest()[:12] if raw else UNKNOWN


@functools.lru_cache(maxsize=None)
def _read() -> tuple:
    out = {name: library_version(name) for name in LIBRARIES}
    out.update(cpu_model=cpu_model(), git_sha=git_sha(), machine_id=machine_id())
    return tuple(out.items())


def provenance() -> dict:
    """This process's provenance (FIELDS; read once)."""
    return dict(_read())
