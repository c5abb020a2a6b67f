"""A llama-server of its own for one configuration (`TempServer`): the spec with the configuration's values
planned again on a free loopback port (a configuration whose plan has errors is refused), started through
the appliance's one runner, waited on until it answers, stopped on exit. And the /proc sampling that tells
whether other processes took the CPUs while a sample ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from appliance.measure.config import BenchError, Config, configured
from appliance.plan.plan import plan
from appliance.plan.validate import Validated
from appliance.runtime.server_api import ServerApi, ServerUnreachable, read_api_key
from appliance.spec.problems import Severity
from appliance.system.run import DEVNULL, STDOUT, Popen, TimeoutExpired, spawn

LOAD_TIMEOUT = 900.0  # a 27B model takes minutes to load
STOP_TIMEOUT = 30.0


def server_argv(validated: Validated, config: Config, port: int) -> list[str]:
    """The llama-server argv of the spec configured with `config`, planned again on 127.0.0.1:port, in the
    binary's dialect. For the baseline no speculative flag is given at all (no draft model is loaded)."""
    spec = configured(validated.plan.spec, config)
    spec = spec.model_copy(update={"server": spec.server.model_copy(update={"host": "127.0.0.1", "port": port})})
    draft = validated.plan.draft if config.draft else None
    planned = plan(spec, validated.facts, validated.plan.target, draft)
    errors = [p for p in planned.problems if p.severity is Severity.ERROR]
    if errors:
        problems = "; ".join(f"{p.field}: {p.message}" for p in errors)
        raise BenchError(f"cannot run llama-server with {config.label()}: {problems}")
    return list(planned.argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan servers


class ServerLog:
    """What a server prints, in a temporary file; its last error line says why it did not start."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile(prefix="llm-appliance-bench-", suffix=".log")  # noqa: SIM115

    def clear(self) -> None:
        self.file.seek(0)
        self.file.truncate()

    def tail(self) -> str:
        self.file.flush()
        lines = Path(self.file.name).read_text(errors="replace").splitlines()
        errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
        return (errors[-1] if errors else lines[-1] if lines else "").strip()

    def close(self) -> None:
        self.file.close()


class TempServer:
    """A llama-server of its own for one configuration: started on a free loopback port, stopped on exit."""

    def __init__(self, validated: Validated, config: Config, load_timeout: float = LOAD_TIMEOUT) -> None:
        self.validated = validated
        self.config = config
        self.load_timeout = load_timeout
        self.process: Popen[str] | None = None
        self.api = ServerApi("http://127.0.0.1:0")
        self.log = ServerLog()
        self.api_key = read_api_key(validated.plan.spec.server.api_key_file)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> TempServer:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        for _attempt in range(3):  # another process may take the free port first
            port = free_port()
            argv = server_argv(self.validated, self.config, port)
            self.log.clear()
            self.process = spawn(
                argv, stdin=DEVNULL, stdout=self.log.file, stderr=STDOUT, preexec_fn=_die_with_parent, quiet=True
            )
            self.api = ServerApi(f"http://127.0.0.1:{port}", self.api_key, timeout=5.0)
            if wait_ready(self.process, self.api, self.load_timeout):
                return
            if "bind" not in self.log.tail().lower():
                break
        raise BenchError(f"llama-server for {self.config.label()} did not start: {self.log.tail() or 'no output'}")

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.process is not None:
            stop(self.process)
        self.log.close()


def wait_ready(process: Popen[str], api: ServerApi, timeout: float) -> bool:
    """Whether the server answers /health with 200 within `timeout` seconds (False once it has exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if api.health() == 200:
                return True
        except ServerUnreachable:
            pass
        time.sleep(0.1)
    return False


def stop(process: Popen[str]) -> None:
    """Terminate, and kill what does not end within STOP_TIMEOUT seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds from /proc: the whole machine's, and those of the server and this process."""

    total: float  # seconds, all CPUs, idle included
    busy: float
    ours: float  # the server's and this process's own

    @classmethod
    def read(cls, pid: int | None) -> CpuTimes | None:
        if pid is None:
            return None
        try:
            tick = os.sysconf("SC_CLK_TCK")
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
            server = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ours = (int(server[11]) + int(server[12])) / tick + sum(os.times()[:2])
        except (OSError, ValueError, IndexError):
            return None
        return cls(sum(values) / tick, (sum(values) - values[3] - values[4]) / tick, ours)


def others_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The share of all CPUs other processes used between two readings (steal time included)."""
    if before is None or after is None or after.total <= before.total:
        return None
    others = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, others) / (after.total - before.total)
