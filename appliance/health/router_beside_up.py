"""The router beside `llm-appliance up` ([fallback]), and what ends it with `up`.

`up` drops to the service user, which can neither signal the router's own user nor remove the directory of
root's that the router's config is rendered into. So `up`, while still root, starts a keeper: `llm-appliance
router --beside-up`, which stays root and does nothing else. It reads the appliance from its stdin, renders the
router's files into a directory of its own and runs the router as its child; `up` holds the other end of that
stdin and never writes to it again. However `up` ends (Ctrl-C, SIGTERM, the start limit, an exception, SIGKILL)
the kernel closes that end: the keeper reads end-of-file, stops the router, removes the directory and exits.

Not a parent-death signal from `up`: the kernel sends it with the dying parent's permission to signal (kill(2)'s
rule), and `up`, the service user by then, has none over the router's user, so the router outlived it. The
router's parent-death signal comes from the keeper, root, which has (and it fires on the death of the thread
that forked, which in the keeper is its only one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from appliance.plan.resolved import Appliance
from appliance.render.render import render
from appliance.render.router_files import CONFIG_DIR
from appliance.system.files import write_atomically
from appliance.system.run import DEVNULL, PIPE, Popen, TimeoutExpired, spawn

log = logging.getLogger("llm-appliance.router")
ROUTER_STOP_SECONDS = 10.0  # LiteLLM's graceful shutdown (uvicorn's), then SIGKILL
# What `up` waits for the keeper: the router's stop, and the directory removed.
KEEPER_STOP_SECONDS = ROUTER_STOP_SECONDS + 20.0
POLL_MILLISECONDS = 1000  # how soon the keeper notices that the router exited by itself


@dataclass
class RouterBesideUp:
    """`up`'s handle on the keeper: its stdin is the lifeline."""

    keeper: Popen[str]

    @classmethod
    def start(cls, appliance: Appliance, as_current_user: bool) -> RouterBesideUp | None:
        """The keeper, started as the user `up` is now (root, before it drops); None without [fallback]."""
        if appliance.router is None:
            return None
        argv = [sys.executable, "-m", "appliance.cli", "router", "--beside-up"]
        keeper = spawn(argv + (["--as-current-user"] if as_current_user else []), stdin=PIPE)
        assert keeper.stdin is not None
        try:
            # One line; the pipe holds it (a few kilobytes) and the keeper reads it at once.
            keeper.stdin.write(json.dumps(appliance.document()) + "\n")
            keeper.stdin.flush()
        except OSError as exc:  # it died at once: `up` serves without its router, as the unit's would
            log.error("the router's keeper exited before it read the appliance: %s", exc)
        return cls(keeper)

    def stop(self) -> None:
        """Close the lifeline and wait until the keeper has stopped the router and removed its directory."""
        assert self.keeper.stdin is not None
        with contextlib.suppress(OSError):
            self.keeper.stdin.close()
        try:
            self.keeper.wait(KEEPER_STOP_SECONDS)
        except TimeoutExpired:
            log.warning("the router's keeper (pid %d) has not stopped the router yet; it goes on", self.keeper.pid)


def keep_beside_up(as_current_user: bool) -> int:
    """`router --beside-up`: the keeper. The router's exit code when it ended by itself, else 0."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)  # each one wakes the poll below through the wakeup fd
    document = _read_line(0)
    if document is None:
        return 0  # `up` went before it said what to run
    appliance = Appliance.from_document(json.loads(document))
    directory = Path(tempfile.mkdtemp(prefix="llm-appliance-router-"))
    try:
        # Root's, read by the router's user, written by nobody else: the router loads the gate as code.
        directory.chmod(0o755)
        for relative, text in render(appliance).items():
            if relative.startswith(CONFIG_DIR):
                write_atomically(directory / Path(relative).name, text, mode=0o644)
        argv = [sys.executable, "-m", "appliance.cli", "router", "--config-dir", str(directory)]
        router = spawn(argv + (["--as-current-user"] if as_current_user else []), stdin=DEVNULL)
        try:
            why = _wait_for_an_end(router, wake_read)
        finally:
            _stop(router)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    code = router.returncode if why == "the router exited" else 0
    log.info("router stopped (%s), %s removed", why if code == 0 else f"{why}, code {code}", directory)
    return code


def _read_line(descriptor: int) -> str | None:
    """The first line written to the descriptor, read unbuffered (it is polled for end-of-file afterwards)."""
    chunks = b""
    while not chunks.endswith(b"\n"):
        chunk = os.read(descriptor, 1 << 16)
        if not chunk:
            return None
        chunks += chunk
    return chunks.decode()


def _wait_for_an_end(router: Popen[str], wake: int) -> str:
    poller = select.poll()
    poller.register(0, select.POLLIN)  # end-of-file (POLLHUP) is always reported
    poller.register(wake, select.POLLIN)
    while True:
        for descriptor, _ in poller.poll(POLL_MILLISECONDS):
            if descriptor == wake:
                return "asked by a signal"
            if not os.read(0, 1 << 16):
                return "`up` is gone"
        if router.poll() is not None:
            return "the router exited"


def _stop(router: Popen[str]) -> None:
    if router.poll() is None:
        router.terminate()
        try:
            router.wait(ROUTER_STOP_SECONDS)
        except TimeoutExpired:
            log.warning("the router ignored SIGTERM for %.0f s; killing it", ROUTER_STOP_SECONDS)
            router.kill()
            router.wait()
