"""write-then-rename version directories for engines that load weights from disk."""
import os

import pytest

from pipelinerl_jax.transport.versioned_dir import (
    gc_versions, latest_version, list_versions, version_dir, write_versioned_dir)


def _writer(text):
    def write(tmp):
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write(text)
        os.makedirs(os.path.join(tmp, "sub"))
        open(os.path.join(tmp, "sub", "config.json"), "w").write("{}")
    return write


def test_write_then_rename(tmp_path):
    root = str(tmp_path / "weights")
    path = write_versioned_dir(root, 3, _writer("v3"))
    assert path == os.path.join(root, "v00000003") == version_dir(root, 3)
    assert open(os.path.join(path, "model.safetensors")).read() == "v3"
    assert os.listdir(root) == ["v00000003"]  # no temp directory left behind
    with pytest.raises(FileExistsError):
        write_versioned_dir(root, 3, _writer("again"))
    write_versioned_dir(root, 3, _writer("v3b"), overwrite=True)
    assert open(os.path.join(path, "model.safetensors")).read() == "v3b"
    assert os.listdir(root) == ["v00000003"]


def test_a_failing_writer_leaves_nothing(tmp_path):
    root = str(tmp_path)

    def broken(tmp):
        _writer("partial")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_versioned_dir(root, 1, broken)
    assert os.listdir(root) == [] and latest_version(root) is None


def test_gc_keeps_the_newest_and_those_in_use(tmp_path):
    root = str(tmp_path)
    for v in (1, 2, 5, 10, 11):
        write_versioned_dir(root, v, _writer(str(v)))
    os.makedirs(os.path.join(root, ".tmp-v00000004-deadbeef"))  # a crashed writer
    os.makedirs(os.path.join(root, ".tmp-v00000012-0123abcd"))  # a writer still at work
    assert gc_versions(root, keep_versions=2, in_use=[2]) == [1, 5]
    assert list_versions(root) == [2, 10, 11] and latest_version(root) == 11
    assert sorted(os.listdir(root)) == [".tmp-v00000012-0123abcd", "v00000002", "v00000010",
                                        "v00000011"]
    with pytest.raises(ValueError):
        gc_versions(root, keep_versions=0)
