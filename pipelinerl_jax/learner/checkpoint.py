"""Orbax checkpoints of the learner: train state + a JSON record of where the run stands.

A checkpoint at step s holds the `TrainState` (params, optimizer state, step) and `meta`:
the policy version, the RNG seed state, the ids of every batch trained up to s (the data
cursor, so a redelivered batch whose step was already committed is never trained twice),
and anything else the loop wants back. Saves are asynchronous (training continues while the
previous save is written); `keep` bounds how many are kept. Restoring places every array
directly into the sharding of the abstract target.

A save that fails (disk full, unwritable directory) raises `CheckpointSaveError` naming the
step, the directory, the underlying error and the last complete checkpoint; earlier
checkpoints are untouched because orbax writes to a temporary directory
(`<step>.orbax-checkpoint-tmp*`). An asynchronous save's error surfaces at the next
`save`/`wait`.

Orbax's own view of "complete" is not enough: an asynchronous save can rename its temporary
directory to `<step>` and only then fail writing its metadata (seen with ENOSPC), leaving a
directory that `CheckpointManager.latest_step()` reports. So a step counts as committed only
once `wait()` has seen its save succeed and recorded it in `committed_steps.json` (written
atomically); `latest_step()` and `restore()` use only recorded steps, and a step directory
that is not recorded is deleted when the checkpointer opens the directory or its save fails.

Multi-process learners (orbax multi-host): every process opens the same directory (a
filesystem all learner hosts share) and calls `save`, `wait`, `restore` and `close` at the
same points; each writes its own shards, and process 0 alone (orbax's primary host) writes
metadata, deletes steps and writes the commit record.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp


RECORD = "committed_steps.json"


class CheckpointSaveError(RuntimeError):
    pass


def committed_steps(directory: str) -> list:
    """The committed steps of a checkpoint directory, read without opening it (a directory
    written before the commit record existed: its bare step directories, which orbax only
    renames into place once written)."""
    path = os.path.join(directory, RECORD)
    try:
        with open(path) as f:
            return sorted(int(s) for s in json.load(f)["steps"])
    except FileNotFoundError:
        if not os.path.isdir(directory):
            return []
        return sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path} is unreadable ({e}); it lists the committed checkpoint "
                           f"steps of {directory}") from e


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        self._primary = jax.process_index() == 0  # orbax's primary host writes shared files
        os.makedirs(self.directory, exist_ok=True)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                 enable_async_checkpointing=async_save,
                                                 create=True))
        self._async = async_save
        self._pending: Optional[int] = None  # step of the save in flight, if any
        self._reported = False  # a save failure was raised to the caller already
        self._record = os.path.join(self.directory, RECORD)
        self._committed = self._load_record()
        self._drop_uncommitted()

    # ------------------------------------------------------------------ the commit record

    def _load_record(self) -> set:
        steps = set(committed_steps(self.directory))
        if not os.path.exists(self._record):
            self._write_record(steps)  # a directory written before the record existed
        return steps

    def _write_record(self, steps) -> None:
        if not self._primary:
            return
        tmp = self._record + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"steps": sorted(steps)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._record)

    def _drop_uncommitted(self) -> None:
        # Every process must see the same steps: orbax's delete is a collective.
        ocp.multihost.sync_global_processes("pipelinerl:checkpoint_listing")
        self._mngr.reload()
        for step in self._mngr.all_steps(read=True):
            if step not in self._committed:
                logging.warning("deleting checkpoint step %d in %s: its save never completed",
                                step, self.directory)
                try:
                    self._mngr.delete(step)
                except Exception as e:  # noqa: BLE001 - it is ignored either way
                    logging.warning("could not delete step %d: %s", step, e)
        self._mngr.reload()

    def _commit(self, step: int) -> None:
        present = set(self._mngr.all_steps(read=True))
        self._committed = {s for s in self._committed | {step} if s in present}
        self._write_record(self._committed)

    def latest_step(self) -> Optional[int]:
        return max(self._committed, default=None)

    def save(self, step: int, state: Any, meta: dict, history: Optional[dict] = None) -> None:
        """`history` ({version: params}) is saved too when given (lag injection replays old
        versions after a restart)."""
        meta = dict(meta, history_versions=sorted(history or {}))
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if history:
            items["history"] = ocp.args.StandardSave({f"v{v}": p for v, p in history.items()})
        self.wait()  # a failure of the previous (asynchronous) save is reported first
        self._pending = step
        try:
            self._mngr.save(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - report what failed and where
            raise self._error(e) from e
        if not self._async:
            self.wait()  # records the commit

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written (errors surface in `wait`)."""
        return self._mngr.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are durable; re-raises their errors."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from e
        if self._pending is not None:
            self._commit(self._pending)
        self._pending = None

    def _error(self, e: Exception) -> CheckpointSaveError:
        step, self._pending = self._pending, None
        self._reported = True
        try:  # a failed save may have left a `<step>` directory (several processes: the
            # failure may not reach them all at once, so the next open cleans up)
            if jax.process_count() == 1:
                self._drop_uncommitted()
        except Exception:  # noqa: BLE001 - the message matters more than the clean-up
            pass
        last = self.latest_step()
        kept = (f"the last complete checkpoint, step {last}, is intact" if last is not None
                else "there is no complete checkpoint yet")
        what = f"of step {step} " if step is not None else ""
        return CheckpointSaveError(f"checkpoint save {what}to {self.directory} failed "
                                   f"({type(e).__name__}: {e}); {kept}")

    def restore(self, abstract_state: Any, step: Optional[int] = None,
                history_like: Any = None) -> Tuple[Any, dict, int, dict]:
        """(state, meta, step, history) of `step` (default: latest); arrays are placed like
        `abstract_state`; `history` (saved versions' params, shaped like `history_like`) is
        restored to host memory."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(meta["meta"])
        items = dict(state=ocp.args.StandardRestore(
            jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)))
        versions = meta.get("history_versions") or []
        if versions and history_like is not None:
            cpu = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            host = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu),
                                history_like)
            items["history"] = ocp.args.StandardRestore({f"v{v}": host for v in versions})
        out = self._mngr.restore(step, args=ocp.args.Composite(**items))
        history = {}
        if "history" in items:
            history = {v: jax.device_get(out["history"][f"v{v}"]) for v in versions}
        return out["state"], meta, step, history

    def read_state(self, step: Optional[int] = None) -> Tuple[dict, dict, int]:
        """(state, meta, step) of `step` (default: latest) as saved, without a target: the
        state's fields (`params`, `opt_state`, `step`) as nested dicts of host arrays. For
        tools reading a finished run (scripts/export_lora.py); a resuming learner uses
        `restore`, which places every array like its own state."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self._committed:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in "
                                    f"{self.directory} (complete: {sorted(self._committed)})")
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
        return jax.device_get(out["state"]), dict(out["meta"]), step

    def close(self) -> None:
        """Waits for a pending save, then closes. A failure raised to the caller already is
        not raised again (orbax keeps a failed save's error and repeats it on close)."""
        reported = self._reported
        try:
            self.wait()
            self._mngr.close()
        except CheckpointSaveError:
            if not reported:
                raise
        except Exception as e:  # noqa: BLE001 - orbax's close re-raising the save's error
            if not reported:
                raise self._error(e) from e
