"""The directories under /var/lib/llm-appliance and who owns them, and the move from the layout before.

    /var/lib/llm-appliance          root 0755           baseline.json (bench, tune), shipped-specs.json (install)
    /var/lib/llm-appliance/models   root 0755           the models, root 0644: the server reads them, never writes
    /var/lib/llm-appliance/state    llm-appliance 0700  the units' StateDirectory=llm-appliance/state

The service user is what a compromised llama-server has: nothing root writes or later trusts is in a place
it can change. systemd creates and chowns only the innermost directory of StateDirectory= (recursively, when
its owner is wrong) and leaves the parents to root, so the units name llm-appliance/state, never the whole
tree as the layout before did (StateDirectory=llm-appliance chowned everything under it, models included, to
the service user). `take_back` returns such a tree to root and removes what only the service user can have
put there.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from appliance.system import paths
from appliance.system.users import Account, exposure

STATE_MODE = 0o700
OLD_RECORD = "shipped-etc.json"  # the layout before kept it where the service user could rewrite it
HISTORY = "health-state.json"
Say = Callable[[str], None]


class LayoutError(Exception):
    """/var/lib/llm-appliance is somewhere the service user could still change it."""


def ensure(root: Path, who: Account | None, say: Say) -> None:
    """The three directories, created if missing; on the live system (`who` given) owned as above."""
    lib, models, state = (root / p.relative_to("/") for p in (paths.LIB, paths.MODELS, paths.STATE))
    if who is not None and lib.is_dir():
        take_back(lib, models, state, who, say)
    for directory in (lib, models, state):
        if not directory.is_dir():
            directory.mkdir(parents=True)
            directory.chmod(0o755)  # whatever the umask: the service user reaches state/ and reads the models
            say(f"created {directory}")
    if who is None:
        return
    for directory in (lib, models):
        reason = exposure(directory, who)
        if reason:
            raise LayoutError(f"{directory} is not root's alone: {reason}; move it to a directory only root can write")
    descriptor = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        status = os.fstat(descriptor)
        if (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) != (who.uid, who.gid, STATE_MODE):
            os.fchown(descriptor, who.uid, who.gid)
            os.fchmod(descriptor, STATE_MODE)
            say(f"gave {state} to {who.name} (mode {STATE_MODE:04o}): the one directory the service writes")
    finally:
        os.close(descriptor)


def take_back(lib: Path, models: Path, state: Path, who: Account, say: Say) -> None:
    """Return the layout before to root: /var/lib/llm-appliance and its models become root's, with nothing
    writable by anyone else; what the service user left beside state/ goes (its restart history moves into
    state/); the old shipped-spec record is dropped (it could have been rewritten: every shipped spec that
    differs from the new one is then kept as the admin's, the new version beside it as NAME.dist)."""
    if exposure(lib.parent, who):
        raise LayoutError(f"{lib.parent} is writable by {who.name}: the appliance's directories cannot be made safe")
    _own_directory(lib, who, say)
    if state.is_symlink() or (state.exists() and not state.is_dir()):
        # Before anything moves into it: lib is root's now, so the name cannot be swapped again.
        state.unlink()
        say(f"removed {state}: not a directory (a link the service user could have planted)")
    for entry in sorted(os.scandir(lib), key=lambda e: e.name):
        path = Path(entry.path)
        found = entry.stat(follow_symlinks=False)
        if entry.name == state.name and stat.S_ISDIR(found.st_mode):
            continue
        if entry.name == OLD_RECORD:
            path.unlink()
            say(
                f"removed {path}: it lay where the service user could rewrite it; specs that differ from the shipped ones are now kept as the admin's"
            )
        elif entry.name == models.name and stat.S_ISDIR(found.st_mode):
            _own_tree(path, who, say)
        elif found.st_uid != who.uid:
            continue
        elif entry.name == HISTORY and stat.S_ISREG(found.st_mode) and not (state / HISTORY).exists():
            state.mkdir(mode=STATE_MODE, exist_ok=True)
            os.rename(path, state / HISTORY)  # renames the entry itself: never follows a link
            say(f"moved the restart history {path} into {state}")
        else:
            if stat.S_ISDIR(found.st_mode):
                shutil.rmtree(path)  # never follows a link inside
            else:
                path.unlink()
            say(f"removed {path}: {who.name}'s, in what is now root's directory")


def _own_directory(directory: Path, who: Account, say: Say) -> None:
    # /var/lib/llm-appliance itself may be the admin's link to a larger disk: only root can have made it there
    # (take_back checked its parent first); every link below it is left unfollowed.
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _own(descriptor, directory, who, say)
    finally:
        os.close(descriptor)


# What root keeps of a mode it takes back: read and execute for all, write for root alone; never a set-id or
# sticky bit. chown clears set-id bits, and a chmod back to the old mode would set them again: the service
# user's 04777 file would become a setuid-root binary.
KEPT_MODE = 0o755


def _own(descriptor: int, shown: Path, who: Account, say: Say) -> None:
    """Root's, and writable by nobody else (through the descriptor: the name could be swapped meanwhile)."""
    status = os.fstat(descriptor)
    mode = stat.S_IMODE(status.st_mode)
    if status.st_uid == who.uid or status.st_gid == who.gid:
        os.fchown(descriptor, 0, 0)
        say(f"took {shown} back from {who.name}")
    kept = mode & KEPT_MODE
    if stat.S_IMODE(os.fstat(descriptor).st_mode) != kept:
        os.fchmod(descriptor, kept)
        say(f"{shown}: mode {mode:04o} -> {kept:04o}")


def _own_tree(directory: Path, who: Account, say: Say) -> None:
    """The models: every directory made root's before it is listed (then no entry in it can be swapped), every
    model root's and read-only to others, every link or special file of the service user's removed."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _own(descriptor, directory, who, say)
        for name in sorted(os.listdir(descriptor)):
            found = os.stat(name, dir_fd=descriptor, follow_symlinks=False)
            path = directory / name
            if stat.S_ISDIR(found.st_mode):
                _own_tree(path, who, say)
            elif stat.S_ISREG(found.st_mode):
                model = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=descriptor)
                try:
                    _own(model, path, who, say)
                finally:
                    os.close(model)
            elif found.st_uid == who.uid:
                os.unlink(name, dir_fd=descriptor)
                say(f"removed {path}: {who.name}'s link or special file among the models")
    finally:
        os.close(descriptor)
