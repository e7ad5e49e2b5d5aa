"""Disk full at checkpoint time: the save fails with an error that names the step, the
directory, the cause and the checkpoint that is still intact; that checkpoint restores bit for
bit, a restarted learner sees it as the latest, and saving works again once there is room.

The disk is filled by making every file write under the checkpoint directory fail with
ENOSPC (the tests run as root, so permissions cannot make a directory unwritable)."""
import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from pipelinerl_jax.learner.checkpoint import Checkpointer, CheckpointSaveError, committed_steps


def _state(scale):
    return {"params": {"w": jnp.arange(12.0).reshape(3, 4) * scale, "b": jnp.ones(4) * scale},
            "step": jnp.asarray(int(scale), jnp.int32)}


@pytest.fixture
def disk_full(monkeypatch):
    """`with disk_full(directory):` every write below `directory` fails with ENOSPC."""
    import contextlib

    @contextlib.contextmanager
    def fill(directory):
        originals = {name: getattr(epath.Path, name) for name in ("write_text", "write_bytes")}

        def failing(name):
            def write(self, *args, **kwargs):
                if str(self).startswith(directory):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
                return originals[name](self, *args, **kwargs)
            return write
        for name in originals:
            monkeypatch.setattr(epath.Path, name, failing(name))
        try:
            yield
        finally:
            for name, fn in originals.items():
                monkeypatch.setattr(epath.Path, name, fn)
    return fill


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_keeps_the_previous_checkpoint_and_says_what_failed(tmp_path, disk_full,
                                                                      async_save):
    directory = str(tmp_path / "checkpoints")
    ckpt = Checkpointer(directory, keep=3, async_save=async_save)
    ckpt.save(2, _state(2), {"version": 2, "trained_batch_ids": ["a", "b"]})
    ckpt.wait()
    with disk_full(directory), pytest.raises(CheckpointSaveError) as e:
        ckpt.save(4, _state(4), {"version": 4, "trained_batch_ids": ["a", "b", "c", "d"]})
        ckpt.wait()  # an asynchronous save reports here
    msg = str(e.value)
    assert f"checkpoint save of step 4 to {directory} failed" in msg
    assert "No space left on device" in msg and "OSError" in msg
    assert "the last complete checkpoint, step 2, is intact" in msg
    assert ckpt.latest_step() == 2
    ckpt.close()

    # A restarted learner: the half-written step 4 is invisible, step 2 restores exactly.
    again = Checkpointer(directory, keep=3, async_save=async_save)
    assert again.latest_step() == 2
    state, meta, step, _ = again.restore(_state(0))
    assert step == 2 and meta["version"] == 2 and meta["trained_batch_ids"] == ["a", "b"]
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(_state(2))):
        np.testing.assert_array_equal(got, want)
    # Room again: the next save lands, and step 2 is still there.
    again.save(6, _state(6), {"version": 6, "trained_batch_ids": []})
    again.wait()
    assert again.latest_step() == 6 and committed_steps(again.directory) == [2, 6]
    again.close()


def test_no_checkpoint_yet_is_said_so(tmp_path, disk_full):
    directory = str(tmp_path / "checkpoints")
    ckpt = Checkpointer(directory, async_save=False)
    with disk_full(directory), pytest.raises(CheckpointSaveError,
                                             match="there is no complete checkpoint yet"):
        ckpt.save(1, _state(1), {"version": 1})
    assert ckpt.latest_step() is None
    ckpt.close()


def test_a_step_directory_without_a_commit_record_is_never_restored(tmp_path):
    """Orbax can rename `<step>.orbax-checkpoint-tmp` to `<step>` and fail afterwards; such a
    directory is not in `committed_steps.json`, so a reopened checkpointer deletes it and
    resumes from the last recorded step."""
    import json
    directory = str(tmp_path / "checkpoints")
    ckpt = Checkpointer(directory, keep=3, async_save=True)
    for step in (2, 4):
        ckpt.save(step, _state(step), {"version": step, "trained_batch_ids": []})
        ckpt.wait()
    ckpt.close()
    record = os.path.join(directory, "committed_steps.json")
    with open(record) as f:
        assert json.load(f)["steps"] == [2, 4]
    with open(record, "w") as f:
        json.dump({"steps": [2]}, f)  # step 4 renamed into place, its commit never recorded
    again = Checkpointer(directory, keep=3)
    assert again.latest_step() == 2
    assert not os.path.exists(os.path.join(directory, "4"))
    state, meta, step, _ = again.restore(_state(0))
    assert step == 2 and meta["version"] == 2
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.arange(12.0).reshape(3, 4) * 2)
    again.close()
