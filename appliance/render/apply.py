"""Put rendered files under a root, report what changed, reload what must.

Every file goes through system.files' atomic writer (a temporary file in its own directory, synced,
renamed over the old one), so a crash or a full disk never leaves a half-written unit or ruleset under /etc.
"""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path

from appliance.system import paths
from appliance.system.files import write_atomically
from appliance.system.run import CommandFailed, run

FILE_MODE = 0o644


class ApplyError(Exception):
    """A write or a reload failed; the message names the file or command and what it said."""


@dataclass(frozen=True)
class Change:
    path: str  # relative to the root
    old: str | None
    new: str

    @property
    def kind(self) -> str:
        return "create" if self.old is None else "update"

    def diff(self) -> str:
        return "".join(
            difflib.unified_diff(
                (self.old or "").splitlines(keepends=True),
                self.new.splitlines(keepends=True),
                fromfile=f"a/{self.path}" if self.old is not None else "/dev/null",
                tofile=f"b/{self.path}",
            )
        )


def changes(files: dict[str, str], root: Path) -> list[Change]:
    found = []
    for relative, text in sorted(files.items()):
        target = root / relative
        try:
            old: str | None = target.read_text()
        except FileNotFoundError:
            old = None
        except (OSError, UnicodeDecodeError) as exc:
            raise ApplyError(f"cannot read {target}: {exc}") from None
        if old != text:
            found.append(Change(relative, old, text))
    return found


def write(found: list[Change], root: Path) -> None:
    for change in found:
        try:
            write_atomically(root / change.path, change.new, FILE_MODE)
        except OSError as exc:
            raise ApplyError(
                f"cannot write {root / change.path}: {exc.strerror}; nothing after it was written"
            ) from None


def systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir()


def reload_system(found: list[Change]) -> list[str]:
    """After a write to the live root: reload systemd for unit changes, load the ruleset if it changed."""
    done = []
    if any(c.path.startswith("etc/systemd/") for c in found) and systemd_running():
        _run(["systemctl", "daemon-reload"])
        done.append("systemctl daemon-reload")
    ruleset = [c for c in found if c.path.endswith(".nft")]
    if ruleset and shutil.which("nft"):
        _run(["nft", "-f", f"/{ruleset[0].path}"])
        done.append(f"nft -f /{ruleset[0].path}")
    return done


def _run(argv: list[str]) -> None:
    try:
        run(argv)
    except CommandFailed as exc:
        raise ApplyError(str(exc)) from None


def installed_spec_path(spec_path: Path) -> Path:
    """The rendered units refer to the spec where apply installs it: /etc/llm-appliance/NAME."""
    return paths.ETC / spec_path.name
