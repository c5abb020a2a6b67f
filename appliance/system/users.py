"""The service user, treated as hostile: it is what a compromised llama-server has.

- `exposure` says whether a directory, or any directory the kernel passes through to reach it, lets the
  service user change what a name there points to: root never writes, nor trusts what it reads, there
  (`files` asks before every write);
- `reading` says whether the service user could read a file, from the modes alone (validate checks the
  API key file as the server will read it, not as root reads it); `denied_as` tries it for real, as the user;
- `drop_to` makes this process the service user for good, as systemd's User= would.
"""

from __future__ import annotations

import ctypes
import grp
import json
import os
import pwd
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.system import paths

PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
CAP_NET_BIND_SERVICE = 10
LINUX_CAPABILITY_VERSION_3 = 0x20080522
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


class NoServiceUser(Exception):
    """Root was to run a program of the appliance's and the service user it runs them as does not exist."""


def runs_as(name: str = paths.SERVICE_USER) -> Account | None:
    """Whom this process runs the appliance's programs as (llama-server, its `--help`, llama.cpp's loader):
    itself (None) unless it is root. Root runs them as the service user, never as itself: whoever could change
    the binary or its libraries would get root. Raises NoServiceUser when root and the user does not exist."""
    if os.geteuid() != 0:
        return None
    who = account(name)
    if who is None:
        raise NoServiceUser(
            f"the service user {name} does not exist, and root runs no llama.cpp itself: "
            f"install.sh creates it (`useradd --system {name}` does too)"
        )
    return who


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
    if entry.st_uid == who.uid:
        return f"{path} can be changed by {who.name}"
    if stat.S_ISLNK(entry.st_mode):
        # A link's own mode is always 0777 and means nothing; what it leads to is what is read or run.
        real = Path(os.path.realpath(path))
        return None if real == path else trusted_status(real, who)
    if may(entry, who, WRITE):
        return f"{path} can be changed by {who.name}"
    return None


def stranger(name: str) -> Account:
    """A user that owns nothing and is in no group, as a user not created yet will be to every existing file
    (install.sh creates the service user with a group of its own): the modes' "other" class."""
    return Account(name, -1, -1, ())


def closed_directories(path: Path, who: Account) -> list[tuple[Path, str]]:
    """Each directory on the way to `path` (as written, and to the file a link leads to) that the modes do not
    let `who` pass (search, x), with the class whose x bit would: "u" its owner, "g" its group, "o" the others.
    ACLs are not read: the real check (`denied_as`, as root) asks the kernel, which applies them."""
    absolute = Path(os.path.abspath(path))
    ways = dict.fromkeys((*reversed(absolute.parents), *reversed(Path(os.path.realpath(absolute)).parents)))
    closed = []
    for directory in ways:
        try:
            status = os.stat(directory)
        except OSError:
            continue  # `reading` says so
        if not may(status, who, SEARCH):
            owner = "u" if status.st_uid == who.uid else "g" if status.st_gid in who.groups else "o"
            closed.append((directory, owner))
    return closed


def reading(path: Path, who: Account) -> str | None:
    """Why `who` could not read the file at `path` (None: it can), from the modes on the way to it."""
    absolute = Path(os.path.abspath(path))
    for directory in reversed(absolute.parents):
        try:
            os.stat(directory)
        except OSError as exc:
            return f"cannot reach {directory}: {exc.strerror}"
    closed = closed_directories(absolute, who)
    if closed:
        directory = closed[0][0]
        return f"{directory} (mode {stat.S_IMODE(os.stat(directory).st_mode):04o}) does not let {who.name} reach it"
    status = os.stat(absolute)
    if not may(status, who, READ):
        return f"its mode {stat.S_IMODE(status.st_mode):04o} does not let {who.name} read it"
    return None


@dataclass(frozen=True)
class Access:
    """A file a unit opens, and how: read, or execute (the binary). Every directory on the way counts, also for
    a file systemd binds into a unit: `up` opens the same path as the same user with no sandbox."""

    path: Path
    execute: bool = False


def denied_as(who: Account, wanted: Sequence[Access]) -> dict[Access, str]:
    """Each access `who` would be refused, with the reason. Root tries them for real: a child process becomes
    `who` (groups, gid, uid, as User= would) and asks the kernel, ACLs included. Anyone else can only read
    the modes on the way (`reading`)."""
    if os.geteuid() != 0:
        return refused_by_modes(who, wanted)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and never returns
        os.close(read_end)
        code = 1
        try:
            answers = _try_as(who, wanted)
            os.write(write_end, json.dumps(answers).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        # The child could not become `who` (a broken account): the modes are still an answer, never a traceback.
        return refused_by_modes(who, wanted)
    refused: list[int] = json.loads(said)
    # The kernel said no; the modes say where, when they can.
    return {
        a: _reading_by_modes(a, who) or f"{who.name} may not {'execute' if a.execute else 'read'} it"
        for i, a in enumerate(wanted)
        if i in refused
    }


def _try_as(who: Account, wanted: Sequence[Access]) -> list[int]:
    """In the child: become `who`, then ask the kernel."""
    os.setgroups(list(who.groups))
    os.setgid(who.gid)
    os.setuid(who.uid)
    return [i for i, a in enumerate(wanted) if not os.access(a.path, os.R_OK | (os.X_OK if a.execute else 0))]


def refused_by_modes(who: Account, wanted: Sequence[Access]) -> dict[Access, str]:
    """`denied_as` from the modes alone, for a user that cannot be become (one not created yet)."""
    return {a: r for a in wanted if (r := _reading_by_modes(a, who))}


def _reading_by_modes(access: Access, who: Account) -> str | None:
    reason = reading(access.path, who)
    if reason:
        return reason
    try:
        status = os.stat(access.path)
    except OSError as exc:
        return f"cannot reach it: {exc.strerror}"
    wanted = READ | (SEARCH if access.execute else 0)
    if not may(status, who, wanted):
        verb = "execute" if access.execute else "read"
        owner = f"{_name(pwd.getpwuid, status.st_uid)}:{_name(grp.getgrgid, status.st_gid)}"
        return f"its mode {stat.S_IMODE(status.st_mode):04o} ({owner}) does not let {who.name} {verb} it"
    return None


def _name(lookup: Callable[[int], Any], number: int) -> str:
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


def drop_to(who: Account, bind_low_ports: bool = False) -> None:
    """Become `who` for good: its groups, its gid, its uid (real, effective and saved), and no_new_privs, so
    no setuid program can give root back. Called before any thread starts (setuid applies to all of them).
    `bind_low_ports` keeps CAP_NET_BIND_SERVICE alone, ambient, so llama-server inherits it, as the unit's
    AmbientCapabilities= would give it for a port below 1024."""
    libc = ctypes.CDLL(None, use_errno=True)
    if bind_low_ports:
        _prctl(libc, "PR_SET_KEEPCAPS", PR_SET_KEEPCAPS, 1)
    os.setgroups(list(who.groups))
    os.setgid(who.gid)
    os.setuid(who.uid)
    if bind_low_ports:
        _keep_only_bind_capability(libc)
    _prctl(libc, "PR_SET_NO_NEW_PRIVS", PR_SET_NO_NEW_PRIVS, 1)
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise PermissionError(f"still able to become root after dropping to {who.name}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _keep_only_bind_capability(libc: ctypes.CDLL) -> None:
    """After setuid with keepcaps: CAP_NET_BIND_SERVICE permitted, effective and inheritable, every other
    capability gone, then raised ambient (ambient needs it permitted and inheritable) to survive execve."""
    bit = 1 << CAP_NET_BIND_SERVICE
    data = (_CapData * 2)(_CapData(bit, bit, bit), _CapData(0, 0, 0))
    if libc.capset(ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"capset(CAP_NET_BIND_SERVICE): {os.strerror(error)}")
    _prctl(libc, "PR_CAP_AMBIENT_RAISE", PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_NET_BIND_SERVICE)


def _prctl(libc: ctypes.CDLL, name: str, option: int, *arguments: int) -> None:
    padded = (*arguments, 0, 0, 0, 0)[:4]
    if libc.prctl(option, *padded) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({name}): {os.strerror(error)}")
