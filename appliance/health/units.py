"""How the daemon sees and restarts the server: through systemd, or through the in-process launcher of
`llm-appliance up`. Both behind one small interface, so the daemon does not care which."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Protocol


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

    def _systemctl(self, *args: str) -> str:
        try:
            result = subprocess.run(
                ["systemctl", *args], capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UnitError(f"systemctl {' '.join(args)}: {exc}") from None
        if result.returncode != 0 and args[0] not in ("is-active",):
            raise UnitError(f"systemctl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout.strip()

    def main_pid(self) -> int | None:
        pid = int(self._systemctl("show", "--property=MainPID", "--value", self.unit) or 0)
        return pid or None

    def active(self) -> bool:
        return self._systemctl("is-active", self.unit) == "active"

    def restart(self, reason: str) -> None:
        # --no-block: the restart may stop this daemon too (it is bound to the server); state is saved first.
        self._systemctl("restart", "--no-block", self.unit)


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
