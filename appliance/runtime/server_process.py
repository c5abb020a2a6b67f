"""One llama-server child's lifecycle, shared by the launcher (the server unit) and bench/tune's servers of their
own: started so that it dies with its parent, waited on until /health answers 200, stopped gracefully (killed
when it ignores SIGTERM); how it ended reads as runtime/server_death.py words it."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from appliance.runtime.server_api import ServerApi, ServerUnreachable
from appliance.system.run import Popen, TimeoutExpired
from appliance.system.users import Account

log = logging.getLogger("llm-appliance.launch")

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT = 30.0


@contextlib.contextmanager
def temporary_key(who: Account | None) -> Iterator[tuple[Path, str]]:
    """A key of a short-lived server's own (the engine proof's, bench's, tune's), in a directory only `who`
    (the server's user) and root can enter, gone afterwards: a loopback port is any local user's to call."""
    directory = Path(tempfile.mkdtemp(prefix="llm-appliance-key-"))
    try:
        key = secrets.token_urlsafe(32)
        key_file = directory / "key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o400)
        if who is not None:
            os.chown(directory, who.uid, who.gid)
            os.chown(key_file, who.uid, who.gid)
        yield key_file, key
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def die_with_parent() -> None:
    """The child's preexec_fn: if its parent is SIGKILLed (the watchdog, the OOM killer, a killed bench), the
    kernel takes llama-server down too, so no orphan holds the port and the GPU."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_until_ready(
    process: Popen[str], api: ServerApi, timeout: float, interrupt: threading.Event | None = None
) -> bool:
    """Whether /health answered 200 within `timeout` seconds. False once the process has exited, or as soon as
    `interrupt` is set (the launcher's stop or restart)."""
    deadline = time.monotonic() + timeout
    pause = interrupt or threading.Event()
    while time.monotonic() < deadline and not pause.is_set():
        if process.poll() is not None:
            return False
        with contextlib.suppress(ServerUnreachable):  # its HTTP server is not up yet
            if api.health() == 200:
                return True
        pause.wait(0.1)
    return False


def stop(process: Popen[str], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM (llama-server finishes the request at hand and exits), SIGKILL after `timeout` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except TimeoutExpired:
            log.warning("llama-server ignored SIGTERM for %.0f s; killing it", timeout)
            process.kill()
            process.wait()


def exit_described(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
