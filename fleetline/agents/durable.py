"""Small files the agent must never leave half-written."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# What a write raises when the disk (or the user's quota, or the file size limit) has no room.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so a crash leaves the old or the new content, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_if_room(path: Path, text: str) -> bool:
    """`write_atomically`, or False when the disk is full (the old content stays, and the
    temporary file is removed); any other error is raised."""
    try:
        write_atomically(path, text)
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        path.with_suffix(path.suffix + ".tmp").unlink(missing_ok=True)
        return False
    return True
