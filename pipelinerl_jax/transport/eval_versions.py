"""The hand-over of versions to evaluate, from the learner to the evaluator role.

    due(version, eval_every, total_steps)         # the schedule: 0, every eval_every, the last
    outbox = EvalOutbox(root, save_model, eval_every, total_steps, describes)  # the learner
    outbox.put(version, flat)                     # a due version -> root/v{version:08d}, later
    outbox.finish(version, flat)                  # the run's last version, then root/final.json
    inbox = EvalInbox(root)                       # the evaluator role
    inbox.pending() -> [(version, path)]          # in version order
    inbox.done(version)                           # its record is written: forget the directory
    inbox.final() -> version or None              # set once the learner finished

A due version is written as a directory by the 'hf_dir' weight sink's writer
(`weight_sink.write_weight_version`, atomically): the message the run publishes
(`describes`), so under LoRA the evaluator receives the adapters (a PEFT directory), not a
merged base, and every engine kind installs it by its kind.
Files rather than the weight stream, because every due version must be evaluated: the stream
sends a subscriber that connects late or falls behind the newest version only, and under lag
injection it carries an older policy's weights than the learner's. A directory is deleted once
its record is written, so a restarted evaluator resumes with what is left; `final.json`
(the learner's last version) tells it when it is done. The writes run on the outbox's own
thread, in order: `put` only queues the version (its arrays are the publication's, never
modified), so a slow disk holds up neither the learner's step nor its publication thread;
`finish` waits for them all.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from concurrent import futures
from typing import Callable, List, Mapping, Optional, Tuple

import numpy as np

from pipelinerl_jax.transport.versioned_dir import version_dir
from pipelinerl_jax.transport.weight_sink import write_weight_version
from pipelinerl_jax.transport.weight_version import WeightVersion

FINAL = "final.json"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
Params = Mapping[str, np.ndarray]


def eval_root(workdir: str) -> str:
    """Where a run's learner hands versions to its evaluator."""
    return os.path.join(workdir, "eval_versions")


def due(version: int, eval_every: int, total_steps: int) -> bool:
    """Whether the learner's schedule evaluates `version` (= its step): the first, every
    `eval_every`-th and the last (`eval_every` 0: none)."""
    if eval_every <= 0:
        return False
    return version == 0 or version % eval_every == 0 or version == total_steps


def clear_final(root: str) -> None:
    """Forgets an earlier run's end (a run resumed in the same directory goes on)."""
    try:
        os.remove(os.path.join(root, FINAL))
    except FileNotFoundError:
        pass


class EvalOutbox:
    """The learner's side. `save_model(flat, directory)` writes one directory
    (`transport.weight_sink.hf_checkpoint_writer`: an HF checkpoint, or for a 'lora'
    `describes` a PEFT adapter directory); `describes`: what the versions are
    (`weight_version.describe_run`). Writes run on the outbox's thread (module docstring);
    an error there is raised by the next `put` or `finish`."""

    def __init__(self, root: str, save_model: Callable[[Params, str], None], eval_every: int,
                 total_steps: int, describes: WeightVersion = WeightVersion("full")):
        self.root, self.save_model, self.describes = root, save_model, describes
        self.eval_every, self.total_steps = eval_every, total_steps
        self.last_put = -1
        self._writer = futures.ThreadPoolExecutor(1, "eval-outbox")
        self._writes: List[futures.Future] = []
        os.makedirs(root, exist_ok=True)
        clear_final(root)

    def put(self, version: int, flat: Params) -> bool:
        """Queues `version` for writing when it is due; returns whether it is."""
        self._raise_failed()
        if not due(version, self.eval_every, self.total_steps):
            return False
        self._queue(version, flat)
        return True

    def finish(self, version: int, flat: Params) -> None:
        """The run ended at `version` (its last step, or earlier when stopped): evaluated
        even when not due; once every write is done, `final.json` names it."""
        if self.last_put != version:
            self._queue(version, flat)
        self.wait()
        tmp = os.path.join(self.root, f".{FINAL}.tmp")
        with open(tmp, "w") as f:
            json.dump({"version": int(version)}, f)
        os.replace(tmp, os.path.join(self.root, FINAL))

    def wait(self) -> None:
        """Until every queued version is written (raising the first error)."""
        writes, self._writes = self._writes, []
        for w in writes:
            w.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    def _raise_failed(self) -> None:
        for w in [w for w in self._writes if w.done()]:
            self._writes.remove(w)
            w.result()

    def _queue(self, version: int, flat: Params) -> None:
        message = self.describes.carrying(version, tensors=flat)
        self._writes.append(self._writer.submit(
            write_weight_version, self.root, message, self.save_model))
        self.last_put = version


class EvalInbox:
    """The evaluator role's side of `root`."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def pending(self) -> List[Tuple[int, str]]:
        """(version, directory) of every version not evaluated yet, oldest first."""
        out = []
        for name in os.listdir(self.root):
            m = _VERSION_DIR.match(name)
            if m:
                out.append((int(m.group(1)), os.path.join(self.root, name)))
        return sorted(out)

    def done(self, version: int) -> None:
        shutil.rmtree(version_dir(self.root, version), ignore_errors=True)

    def final(self) -> Optional[int]:
        """The learner's last version once it finished, else None."""
        try:
            with open(os.path.join(self.root, FINAL)) as f:
                return int(json.load(f)["version"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            return None

    def finished(self) -> bool:
        """The learner finished and every version it handed over was evaluated."""
        return self.final() is not None and not self.pending()
