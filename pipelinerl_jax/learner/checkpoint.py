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
(`<step>.orbax-checkpoint-tmp*`) and renames it only when complete, and `latest_step()` never
returns a half-written one. An asynchronous save's error surfaces at the next `save`/`wait`.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp


class CheckpointSaveError(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                 enable_async_checkpointing=async_save,
                                                 create=True))
        self._pending: Optional[int] = None  # step of the save in flight, if any
        self._reported = False  # a save failure was raised to the caller already

    def latest_step(self) -> Optional[int]:
        return self._mngr.latest_step()

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

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written (errors surface in `wait`)."""
        return self._mngr.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are durable; re-raises their errors."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from e
        self._pending = None

    def _error(self, e: Exception) -> CheckpointSaveError:
        step, self._pending = self._pending, None
        self._reported = True
        try:
            last = self._mngr.latest_step()
        except Exception:  # noqa: BLE001 - the message matters more than this detail
            last = None
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
            cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            host = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu),
                                history_like)
            items["history"] = ocp.args.StandardRestore({f"v{v}": host for v in versions})
        out = self._mngr.restore(step, args=ocp.args.Composite(**items))
        history = {}
        if "history" in items:
            history = {v: jax.device_get(out["history"][f"v{v}"]) for v in versions}
        return out["state"], meta, step, history

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
