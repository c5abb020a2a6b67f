"""The one way the appliance runs another program: logged as `+ cmd`, with a fixed locale, and one
error type that carries the argv, the exit code and the tail of what the program said.

Every module that starts a process goes through here (the launcher's and bench's long-running servers
through `spawn`), so there is one place that decides how commands are logged and how failures read.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any

from appliance.system.users import Account

log = logging.getLogger("llm-appliance.run")
# Re-exported so that callers holding a child process need not import subprocess themselves.
Popen = subprocess.Popen
CompletedProcess = subprocess.CompletedProcess
TimeoutExpired = subprocess.TimeoutExpired
DEVNULL, PIPE, STDOUT = subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT
TAIL = 2000
Stream = int | IO[Any] | None
Argv = Sequence[str | os.PathLike[str]]  # paths are welcome; everything is str by the time it runs


def _as(who: Account | None) -> dict[str, Any]:
    if who is None:
        return {}
    return {"user": who.uid, "group": who.gid, "extra_groups": list(who.groups), "cwd": "/"}


class CommandFailed(Exception):
    """A program could not be started, ran past its timeout, or exited non-zero."""

    def __init__(self, argv: Argv, returncode: int | None, output: str, how: str | None = None) -> None:
        self.argv = [os.fspath(a) for a in argv]
        self.returncode = returncode  # None: it never ran to an exit (not found, not executable, timed out)
        self.output_tail = output.strip()[-TAIL:]
        how = how or ("could not run" if returncode is None else f"exited {returncode}")
        super().__init__(f"`{shlex.join(self.argv)}` {how}" + (f": {self.output_tail}" if self.output_tail else ""))


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    # Tools' messages are parsed and shown to users: keep them in one predictable language.
    return {**os.environ, **(env or {}), "LC_ALL": "C.UTF-8"}


def _announce(argv: Argv, quiet: bool = False) -> list[str]:
    words = [os.fspath(a) for a in argv]
    if not quiet:
        log.info("+ %s", shlex.join(words))
    return words


def run(
    argv: Argv,
    *,
    check: bool = True,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    quiet: bool = False,
    who: Account | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.CompletedProcess[str]:
    """Run to completion, capturing stdout and stderr. A non-zero exit raises CommandFailed when `check`;
    a program that cannot start or runs past `timeout` always does, since it left no result to look at.
    `quiet` is for probes run over and over (the health daemon's systemctl, `--help`): not logged.
    `who`: the account it runs as (its groups, gid and uid), in `/` (root's own directory may be closed to it);
    `pass_fds`: files it inherits open (one root opened for it, as systemd binds one into a unit)."""
    argv = _announce(argv, quiet)
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_environment(env),
            input=input,
            check=False,
            pass_fds=pass_fds,
            **_as(who),
        )
    except OSError as exc:
        raise CommandFailed(argv, None, str(exc)) from None
    except subprocess.TimeoutExpired as exc:
        said = exc.stderr or exc.stdout or ""
        said = said.decode(errors="replace") if isinstance(said, bytes) else said
        raise CommandFailed(argv, None, said, how=f"did not finish within {timeout:g} s") from None
    if check and result.returncode != 0:
        raise CommandFailed(argv, result.returncode, result.stderr or result.stdout)
    return result


def stream(argv: Argv, on_line: Callable[[str], None], *, env: Mapping[str, str] | None = None) -> None:
    """Run to completion, handing each line of its combined output to `on_line` as it comes (long builds)."""
    argv = _announce(argv)
    tail: list[str] = []
    try:
        # errors="replace": one odd byte in a compiler's output must not abort a half-hour build.
        with subprocess.Popen(
            argv, stdout=PIPE, stderr=STDOUT, text=True, errors="replace", env=_environment(env)
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                tail = [*tail[-40:], line]
                on_line(line)
    except OSError as exc:
        raise CommandFailed(argv, None, str(exc)) from None
    if process.returncode != 0:
        raise CommandFailed(argv, process.returncode, "".join(tail))


def spawn(
    argv: Argv,
    *,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    errors: str | None = None,
    bufsize: int = -1,
    preexec_fn: Callable[[], Any] | None = None,
    quiet: bool = False,
    user: int | None = None,
    group: int | None = None,
    extra_groups: list[int] | None = None,
) -> subprocess.Popen[str]:
    """Start a long-running program (llama-server) and return its handle; the caller owns its lifetime.
    Its environment is inherited unchanged: the server's own messages are not parsed, only relayed.
    `quiet`: not logged (bench's servers, while its progress bar holds the terminal). `user`, `group` and
    `extra_groups`: whom it runs as (the service user, when root starts it)."""
    argv = _announce(argv, quiet)
    return subprocess.Popen(
        argv,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=True,
        errors=errors,
        bufsize=bufsize,
        preexec_fn=preexec_fn,
        user=user,
        group=group,
        extra_groups=extra_groups,
    )


@contextmanager
def started(argv: Argv, **options: Any) -> Iterator[subprocess.Popen[str]]:
    """`spawn`, killed and reaped on the way out of the block if it is still running."""
    process = spawn(argv, **options)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
