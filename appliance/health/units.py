"""How the daemon sees and restarts the server: through systemd, or through the in-process launcher of
`llm-appliance up`. Both behind one small interface, so the daemon does not care which."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from appliance.system.run import CommandFailed, run


class UnitError(Exception):
    """systemd could not be asked or did not do what was asked."""


class ServerControl(Protocol):
    def main_pid(self) -> int | None: ...
    def active(self) -> bool: ...
    def restart(self, reason: str) -> None: ...


class SystemdUnit:
    def __init__(self, unit: str, timeout: float = 10.0) -> None:
        self.unit = unit
        self.timeout = timeout

    def _systemctl(self, *args: str, quiet: bool = True) -> str:
        # The daemon asks every few seconds: the questions are quiet, only the restart is logged.
        try:
            # is-active exits non-zero for every state but "active"; its answer is on stdout.
            result = run(["systemctl", *args], timeout=self.timeout, check=args[0] != "is-active", quiet=quiet)
        except CommandFailed as exc:
            raise UnitError(str(exc)) from None
        return result.stdout.strip()

    def main_pid(self) -> int | None:
        pid = int(self._systemctl("show", "--property=MainPID", "--value", self.unit) or 0)
        return pid or None

    def active(self) -> bool:
        return self._systemctl("is-active", self.unit) == "active"

    def restart(self, reason: str) -> None:
        # --no-block: the restart may stop this daemon too (it is bound to the server); state is saved first.
        self._systemctl("restart", "--no-block", self.unit, quiet=False)


def descendants(pid: int) -> set[int]:
    """pid and every process below it (the launcher's llama-server child holds the GPU memory)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo.extend(children.get(current, []))
    return found
