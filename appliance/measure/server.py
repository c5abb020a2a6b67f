"""A llama-server of its own for one configuration (`TempServer`): the spec with the configuration's values
planned again on a free loopback port (a configuration whose plan has errors is refused), started through
the appliance's one runner, waited on until it answers, stopped on exit. And the /proc sampling that tells
whether other processes took the CPUs while a sample ran.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from appliance.measure.config import BenchError, Config, configured
from appliance.plan.plan import plan
from appliance.plan.validate import Validated
from appliance.runtime.server_api import ServerApi
from appliance.runtime.server_death import describe_exit, engine_facts, llama_error
from appliance.runtime.server_process import die_with_parent, free_port, stop, temporary_key, wait_until_ready
from appliance.spec.problems import Severity
from appliance.system.run import DEVNULL, STDOUT, Popen, spawn
from appliance.system.users import NoServiceUser, runs_as

LOAD_TIMEOUT = 900.0  # a 27B model takes minutes to load


def server_argv(validated: Validated, config: Config, port: int, key_file: Path | None = None) -> list[str]:
    """The llama-server argv of the spec configured with `config`, planned again on 127.0.0.1:port (with
    `key_file` as its key, when given), in the binary's dialect. For the baseline no speculative flag is given
    at all (no draft model is loaded)."""
    spec = configured(validated.plan.spec, config)
    server: dict[str, object] = {"host": "127.0.0.1", "port": port}
    if key_file is not None:
        server["api_key_file"] = key_file
    spec = spec.model_copy(update={"server": spec.server.model_copy(update=server)})
    draft = validated.plan.draft if config.draft else None
    planned = plan(spec, validated.facts, validated.plan.target, draft)
    errors = [p for p in planned.problems if p.severity is Severity.ERROR]
    if errors:
        problems = "; ".join(f"{p.field}: {p.message}" for p in errors)
        raise BenchError(f"cannot run llama-server with {config.label()}: {problems}")
    return list(planned.argv)


class ServerLog:
    """What a server prints, in a temporary file; its last error line says why it did not start."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile(prefix="llm-appliance-bench-", suffix=".log")  # noqa: SIM115

    def clear(self) -> None:
        self.file.seek(0)
        self.file.truncate()

    def text(self) -> str:
        self.file.flush()
        return Path(self.file.name).read_text(errors="replace")

    def death(self, process: Popen[str]) -> str:
        """Why the server did not start: how it ended (runtime/server_death.py), else its first error line."""
        lines = self.text().splitlines()
        code = process.poll()
        if code is None:
            return llama_error(lines) or (lines[-1] if lines else "no output")
        sets, cpu = engine_facts(Path(str(process.args[0])))  # type: ignore[index]
        return f"it {describe_exit(code, lines, sets, cpu)}"

    def close(self) -> None:
        self.file.close()


class TempServer:
    """A llama-server of its own for one configuration: started on a free loopback port with a key of its own,
    as the service user when root starts it (as `up` runs it; root runs nothing of the engine's), stopped on
    exit."""

    def __init__(self, validated: Validated, config: Config, load_timeout: float = LOAD_TIMEOUT) -> None:
        self.validated = validated
        self.config = config
        self.load_timeout = load_timeout
        self.process: Popen[str] | None = None
        self.api = ServerApi("http://127.0.0.1:0")
        self.log = ServerLog()
        self.keys = ExitStack()

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
        try:
            who = runs_as()
        except NoServiceUser as exc:
            raise BenchError(str(exc)) from None
        key_file, key = self.keys.enter_context(temporary_key(who))
        for _attempt in range(3):  # another process may take the free port first
            port = free_port()
            argv = server_argv(self.validated, self.config, port, key_file)
            self.log.clear()
            self.process = spawn(
                argv,
                stdin=DEVNULL,
                stdout=self.log.file,
                stderr=STDOUT,
                preexec_fn=die_with_parent,
                quiet=True,
                user=who.uid if who else None,
                group=who.gid if who else None,
                extra_groups=list(who.groups) if who else None,
            )
            self.api = ServerApi(f"http://127.0.0.1:{port}", key, timeout=5.0)
            if wait_until_ready(self.process, self.api, self.load_timeout):
                return
            if "bind" not in self.log.text().lower():
                break
        assert self.process is not None
        raise BenchError(f"llama-server for {self.config.label()} did not start: {self.log.death(self.process)}")

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.process is not None:
            stop(self.process)
        self.keys.close()
        self.log.close()


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
