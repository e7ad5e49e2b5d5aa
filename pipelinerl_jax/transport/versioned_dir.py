"""Versioned weight directories for engines that load from disk (SGLang's
`/update_weights_from_disk`): write-then-rename so a reader never sees a partial version.

    path = write_versioned_dir(root, version, lambda tmp: save_pretrained(model, tmp))
    gc_versions(root, keep_versions=2, in_use={engine_version})

`root/v{version:08d}` appears atomically (one `rename` of a fully written and fsynced temp
directory on the same file system); zero-padding makes lexical order = version order.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Callable, Iterable, Optional

_VERSION_DIR = re.compile(r"^v(\d{8,})$")
_TMP_DIR = re.compile(r"^\.tmp-v(\d{8,})-[0-9a-f]+(-old)?$")


def version_dir(root: str, version: int) -> str:
    return os.path.join(root, f"v{version:08d}")


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_versioned_dir(root: str, version: int, write_fn: Callable[[str], None],
                        overwrite: bool = False) -> str:
    """Calls `write_fn(tmp_dir)`, then atomically renames tmp_dir to `root/v{version:08d}`.

    If `write_fn` raises, the temp directory is removed and nothing appears. An existing
    version directory is an error unless `overwrite` (a learner re-writing a version after
    restarting from an older checkpoint): the old one is then moved aside first, so readers
    see the old or the new directory, or briefly none, never a mix.
    """
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    os.makedirs(root, exist_ok=True)
    final = version_dir(root, version)
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{final} exists (pass overwrite=True to replace it)")
    tmp = os.path.join(root, f".tmp-v{version:08d}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        write_fn(tmp)
        _fsync_tree(tmp)
        if os.path.exists(final):
            trash = tmp + "-old"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_versions(root: str) -> list[int]:
    """Complete versions under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, os.listdir(root)) if m)


def latest_version(root: str) -> Optional[int]:
    versions = list_versions(root)
    return versions[-1] if versions else None


def gc_versions(root: str, keep_versions: int, in_use: Iterable[int] = ()) -> list[int]:
    """Deletes all but the newest `keep_versions` versions (and any in `in_use`).

    Also removes leftover temp directories of versions older than the newest complete one
    (a writer that crashed). Returns the deleted versions.
    """
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    versions = list_versions(root)
    keep = set(versions[-keep_versions:]) | set(in_use)
    deleted = [v for v in versions if v not in keep]
    for v in deleted:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    newest = versions[-1] if versions else -1
    for name in os.listdir(root) if os.path.isdir(root) else ():
        m = _TMP_DIR.match(name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return deleted
