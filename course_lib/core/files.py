"""Files several processes may write at once (two notebooks sharing one checkpoint folder): a
write goes to a temporary name, then os.replace, so a reader never sees half a file;
`training_lock` lets one process train a model while another that wants it waits, then loads it."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from filelock import FileLock


def temporary_name(path) -> Path:
    """A sibling of `path` no other process or thread writes: ".<name>.<pid>-<thread>.tmp"."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def write_atomically(path, write: Callable[[Path], None]) -> None:
    """write(temporary path), then rename it onto `path` (atomic on one file system)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


LOCKS = Path(tempfile.gettempdir()) / "course_lib-locks"  # not in the checkpoint folder


def lock_file(checkpoint_path) -> Path:
    """The lock file in LOCKS of a checkpoint path, named by a hash of its absolute path."""
    key = hashlib.sha1(str(Path(checkpoint_path).resolve()).encode()).hexdigest()[:16]
    return LOCKS / f"{Path(checkpoint_path).name}-{key}.lock"


def training_lock(checkpoint_path):
    """Held while a model trains into `checkpoint_path` (None: no lock, nothing is shared)."""
    if checkpoint_path is None:
        return nullcontext()
    LOCKS.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock_file(checkpoint_path)))
