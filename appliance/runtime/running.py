"""Whether an `llm-appliance up` of a state directory runs: the pid file it keeps there while it runs.

`up` writes its pid and its start time (clock ticks after boot, /proc/PID/stat) atomically to STATE/up.pid and
removes the file on its way out. A reader trusts neither the file nor the number in it: the file lies in the
service user's directory (read without following a link, a regular file, a few bytes), and it outlives its
process after a SIGKILL or a crash, when the pid may come back as another process. The pid counts only while
/proc shows the same process (the same start time) and it is an llm-appliance `up` (or `install`, which ends in
one where systemd is not PID 1).

Beside it, STATE/up.json says what that `up` runs: the spec it was given and the appliance resolved from it,
with the same pid and start time, so `status` describes what runs rather than what is applied. What it says is
the service user's word: `status` only reads the URLs in it and shows its text without control characters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from appliance.plan.resolved import Appliance, SnapshotError
from appliance.system.files import write_atomically

log = logging.getLogger("llm-appliance.up")

PID_FILE = "up.pid"
PID_FILE_LIMIT = 64  # "PID STARTTIME\n": more is not ours
PROGRAMS = ("llm-appliance", "appliance.cli.main", "appliance.cli")  # the script, or `python -m ...`
COMMANDS = ("up", "install")
ANNOUNCEMENT_FILE = "up.json"
ANNOUNCEMENT_LIMIT = 1 << 20  # an appliance's document is a few kilobytes


@dataclass(frozen=True)
class Announcement:
    """What an `up` runs: the spec it was given (as an absolute path) and the appliance resolved from it."""

    spec: str
    appliance: Appliance


def start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's start time (field 22 of /proc/PID/stat), None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])  # fields[0] is field 3, the state
    except (IndexError, ValueError):
        return None


@contextlib.contextmanager
def announced(state_dir: Path, runs: Announcement | None = None) -> Iterator[None]:
    """The pid file of this process, and what it runs, there while the block runs. A state directory it cannot
    write to costs `status` its knowledge that `up` runs, never the serving: logged, not raised."""
    path = state_dir / PID_FILE
    pid = os.getpid()
    started = start_time(pid)
    content = f"{pid} {started}\n"
    written: list[tuple[Path, str]] = []
    if runs is not None:
        document = {"pid": pid, "started": started, "spec": runs.spec, "appliance": runs.appliance.document()}
        written.append((state_dir / ANNOUNCEMENT_FILE, json.dumps(document, sort_keys=True) + "\n"))
    written.append((path, content))  # the pid file last: a reader finds what it runs there already
    done: list[Path] = []
    try:
        for file, text in written:
            write_atomically(file, text, 0o644)
            done.append(file)
    except OSError as exc:
        log.warning("cannot write %s (%s): `llm-appliance status` will not see that `up` runs", file, exc)
        for mine in done:
            with contextlib.suppress(OSError):
                mine.unlink()
        yield
        return
    try:
        yield
    finally:
        # Only ours: a second `up` of the same directory (which could not bind the ports) must not remove them.
        for file, text in reversed(written):
            if read_small(file, ANNOUNCEMENT_LIMIT) == text:
                with contextlib.suppress(OSError):
                    file.unlink()


def running_up(state_dir: Path, proc: Path = Path("/proc")) -> int | None:
    """The pid of the `up` that runs with this state directory, or None when none does."""
    text = read_small(state_dir / PID_FILE, PID_FILE_LIMIT)
    try:
        pid, started = (int(word) for word in (text or "").split())
    except ValueError:
        return None
    if pid <= 0 or start_time(pid, proc) != started:
        return None  # gone, or the number is another process's now
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if is_up(argv) else None


def announcement(state_dir: Path, pid: int, proc: Path = Path("/proc")) -> Announcement | None:
    """What the `up` of `pid` (running_up's answer) says it runs; None when it said nothing (an `up` of an older
    version) or what is there is another process's, or no appliance."""
    text = read_small(state_dir / ANNOUNCEMENT_FILE, ANNOUNCEMENT_LIMIT)
    try:
        document = json.loads(text or "")
        if (document["pid"], document["started"]) != (pid, start_time(pid, proc)):
            return None
        return Announcement(str(document["spec"]), Appliance.from_document(document["appliance"]))
    except (ValueError, KeyError, TypeError, SnapshotError):
        return None


def is_up(argv: list[bytes]) -> bool:
    """An llm-appliance command line whose command is `up` or `install`."""
    words = [os.fsdecode(a) for a in argv if a]
    for i, word in enumerate(words):
        if Path(word).name in PROGRAMS or word in PROGRAMS:
            command = next((w for w in words[i + 1 :] if not w.startswith("-")), None)
            return command in COMMANDS
    return False


def read_small(path: Path, limit: int) -> str | None:
    """A file in the service user's state directory, as root may read it: never through a link, never a FIFO
    or a device (O_NONBLOCK, a regular file only), never more than `limit` bytes."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_size > limit:
            return None
        return os.read(descriptor, limit).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)
