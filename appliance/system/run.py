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

log = logging.getLogger("llm-appliance.run")
Popen = subprocess.Popen
TimeoutExpired = subprocess.TimeoutExpired
DEVNULL, PIPE, STDOUT = subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT
TAIL = 2000


class CommandFailed(Exception):
    """A program could not be started, ran past its timeout, or exited non-zero."""

    def __init__(self, argv: Sequence[str], returncode: int | None, output: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output_tail = output.strip()[-TAIL:]
        how = "could not run" if returncode is None else f"exited {returncode}"
        super().__init__(f"`{shlex.join(self.argv)}` {how}" + (f": {self.output_tail}" if self.output_tail else ""))


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    # Tools' messages are parsed and shown to users: keep them in one predictable language.
    return {**os.environ, **(env or {}), "LC_ALL": "C.UTF-8"}


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    quiet: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run to completion, capturing stdout and stderr; raise CommandFailed on failure when `check`."""
    argv = [str(a) for a in argv]
    if not quiet:
        log.info("+ %s", shlex.join(argv))
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=_environment(env), input=input, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if not check:
            return subprocess.CompletedProcess(argv, -1, "", str(exc))
        raise CommandFailed(argv, None, str(exc)) from None
    if check and result.returncode != 0:
        raise CommandFailed(argv, result.returncode, result.stderr or result.stdout)
    return result


def stream(argv: Sequence[str], on_line: Callable[[str], None], *, env: Mapping[str, str] | None = None) -> None:
    """Run to completion, handing each line of its combined output to `on_line` as it comes (long builds)."""
    argv = [str(a) for a in argv]
    log.info("+ %s", shlex.join(argv))
    tail: list[str] = []
    try:
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_environment(env)
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
    argv: Sequence[str], *, stdout: int | IO[Any] | None = None, quiet: bool = False, **options: Any
) -> subprocess.Popen[str]:
    """Start a long-running program (llama-server) and return its handle; the caller owns its lifetime.
    `quiet`: not logged (bench's servers, while its progress bar holds the terminal)."""
    argv = [str(a) for a in argv]
    if not quiet:
        log.info("+ %s", shlex.join(argv))
    return subprocess.Popen(argv, stdout=stdout, text=True, **options)


@contextmanager
def started(argv: Sequence[str], **options: Any) -> Iterator[subprocess.Popen[str]]:
    process = spawn(argv, **options)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
