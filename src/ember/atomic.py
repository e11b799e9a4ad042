"""Write files so that a reader never sees a half-written one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

TMP_SUFFIX = ".tmp"


def temp_name(path: Path) -> Path:
    # Same folder, so os.replace is a rename on one filesystem and therefore atomic.
    return path.with_name(path.name + TMP_SUFFIX)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write` on a temporary file next to `path`, then rename it into place."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))
