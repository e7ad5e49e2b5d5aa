"""Orbax checkpoints of the learner: train state + a JSON record of where the run stands.

A checkpoint at step s holds the `TrainState` (params, optimizer state, step) and `meta`:
the policy version, the RNG seed state, the ids of every batch trained up to s (the data
cursor, so a redelivered batch whose step was already committed is never trained twice),
and anything else the loop wants back. Saves are asynchronous (training continues while the
previous save is written); `keep` bounds how many are kept. Restoring places every array
directly into the sharding of the abstract target.

A save that fails (disk full, unwritable directory) raises `CheckpointSaveError` naming the
directory; earlier checkpoints are untouched because orbax writes to a temporary directory
and renames it only when complete.
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

    def latest_step(self) -> Optional[int]:
        return self._mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        try:
            self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # noqa: BLE001 - report what failed and where
            raise CheckpointSaveError(
                f"checkpoint save of step {step} to {self.directory} failed: {e}") from e

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are durable; re-raises their errors."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise CheckpointSaveError(f"checkpoint save to {self.directory} failed: {e}") from e

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> Tuple[Any, dict, int]:
        """(state, meta, step) of `step` (default: latest), arrays placed like the abstract."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"]), step

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
