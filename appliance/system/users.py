"""The service user, treated as hostile: it is what a compromised llama-server has.

- `exposure` says whether a directory, or any directory the kernel passes through to reach it, lets the
  service user change what a name there points to: root never writes, nor trusts what it reads, there
  (`files` asks before every write);
- `reading` says whether the service user could read a file, from the modes alone (validate checks the
  API key file as the server will read it, not as root reads it);
- `drop_to` makes this process the service user for good, as systemd's User= would.
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from appliance.system import paths

PR_SET_NO_NEW_PRIVS = 38
MAX_HOPS = 40  # symbolic links followed before the kernel says ELOOP
READ, WRITE, SEARCH = 4, 2, 1


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # every group it is in, its own first

    @property
    def group_name(self) -> str:
        try:
            return grp.getgrgid(self.gid).gr_name
        except KeyError:
            return str(self.gid)


def account(name: str = paths.SERVICE_USER) -> Account | None:
    """The user as the system knows it; None before install has created it."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    groups = [entry.pw_gid, *(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)]
    return Account(name, entry.pw_uid, entry.pw_gid, tuple(dict.fromkeys(groups)))


def may(status: os.stat_result, who: Account, access: int) -> bool:
    """Whether the mode bits give `who` every bit of `access` (READ, WRITE, SEARCH), as the kernel decides:
    the owner class if it owns the file, else the group class if it is in the group, else the others."""
    if who.uid == 0:
        return True
    mode = stat.S_IMODE(status.st_mode)
    if status.st_uid == who.uid:
        granted = mode >> 6
    elif status.st_gid in who.groups:
        granted = mode >> 3
    else:
        granted = mode
    return granted & access == access


def _changeable(directory: os.stat_result, who: Account) -> bool:
    """`who` can add, remove or rename entries of the directory. A sticky directory (/tmp) lets it remove only
    its own entries: those are refused one by one where they are met."""
    if directory.st_uid == who.uid:
        return True  # it could chmod it
    return may(directory, who, WRITE | SEARCH) and not directory.st_mode & stat.S_ISVTX


def exposure(directory: Path, who: Account) -> str | None:
    """Why `who` could redirect a file created in `directory` (an existing directory), or None when it cannot:
    every directory the kernel passes through resolving the path, symbolic links followed one hop at a time as
    the kernel follows them, is checked for entries `who` can change, and every entry met for being `who`'s."""
    pending = list(reversed(Path(os.path.abspath(directory)).parts[1:]))
    current = "/"
    hops = 0
    while True:
        here = os.stat(current)
        if _changeable(here, who):
            return f"{current} is writable by {who.name}"
        if not pending:
            return None
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)  # `current` holds no link: its parent is its parent
            continue
        entry_path = os.path.join(current, name)
        entry = os.lstat(entry_path)
        if entry.st_uid == who.uid:
            return f"{entry_path} belongs to {who.name}"
        if stat.S_ISLNK(entry.st_mode):
            hops += 1
            if hops > MAX_HOPS:
                return f"{directory}: too many levels of symbolic links"
            target = os.readlink(entry_path)
            if os.path.isabs(target):
                current = "/"
            pending.extend(reversed(Path(target).parts[1:] if os.path.isabs(target) else Path(target).parts))
            continue
        if not stat.S_ISDIR(entry.st_mode):
            return f"{entry_path} is not a directory"
        current = entry_path


def trusted_status(path: Path, who: Account) -> str | None:
    """Why the file at `path` is not what root wrote there (None: `who` cannot have changed it): its directory
    is exposed, or the file is `who`'s or writable by it."""
    reason = exposure(path.parent, who)
    if reason:
        return reason
    entry = os.lstat(path)
    if entry.st_uid == who.uid or may(entry, who, WRITE):
        return f"{path} can be changed by {who.name}"
    return None


def reading(path: Path, who: Account) -> str | None:
    """Why `who` could not read the file at `path` (None: it can), from the modes on the way to it."""
    absolute = Path(os.path.abspath(path))
    for directory in reversed(absolute.parents):
        try:
            status = os.stat(directory)
        except OSError as exc:
            return f"cannot reach {directory}: {exc.strerror}"
        if not may(status, who, SEARCH):
            return f"{directory} (mode {stat.S_IMODE(status.st_mode):04o}) does not let {who.name} reach it"
    status = os.stat(absolute)
    if not may(status, who, READ):
        return f"its mode {stat.S_IMODE(status.st_mode):04o} does not let {who.name} read it"
    return None


def drop_to(who: Account) -> None:
    """Become `who` for good: its groups, its gid, its uid (real, effective and saved), and no_new_privs, so
    no setuid program can give root back. Called before any thread starts (setuid applies to all of them)."""
    os.setgroups(list(who.groups))
    os.setgid(who.gid)
    os.setuid(who.uid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(error)}")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise PermissionError(f"still able to become root after dropping to {who.name}")
