"""Write files and folders so that a reader never sees a half-written one: everything is
written under a temporary name in the same folder, flushed to disk, and renamed into place
(a rename within one filesystem is atomic), so a crash at any moment leaves either the old
version or the new one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

TMP_SUFFIX = ".tmp"


def temp_name(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _umask() -> int:
    """The process's umask, read without os.umask's set-and-restore, which another thread
    (an asynchronous checkpoint) could catch half-way."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path for a writer that opens files by name (safetensors, torch.save,
    savefig); on success it is flushed and renamed to `path`, on failure removed."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        _fsync_file(tmp)
        # Some writers (safetensors) create 0600 files; a run's files are read by others on
        # a shared filesystem, so they get what the user's umask gives a new file.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write` on a temporary file next to `path`, then rename it into place."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        write(handle)


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def publish_dir(tmp: Path, final: Path) -> None:
    """Flush every file of the finished folder `tmp` and rename it to `final`, which may be an
    empty folder; a folder with anything in it is never removed before its replacement is
    in place (a crash between the two would leave neither)."""
    for folder, _, files in os.walk(tmp):
        for name in files:
            _fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))
    if final.exists():
        final.rmdir()  # an OSError if it is not empty
    os.replace(tmp, final)
    fsync_dir(final.parent)
