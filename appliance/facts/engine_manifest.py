"""What the installed engine says it is: the manifest `llm-appliance engine install` writes beside it
(where the binary came from, its --version line, source and build options), read by `engine info` and by
the version checks."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.system.files import write_atomically

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Manifest:
    binary: str
    origin: str  # "built", "user" or "path"
    version_line: str
    source: dict[str, str] | None
    backends: list[str]
    build_options: list[str]
    built_at: str

    def write(self, directory: Path) -> None:
        write_atomically(directory / MANIFEST, json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        try:
            return cls(**json.loads((directory / MANIFEST).read_text()))
        except (OSError, ValueError, TypeError):
            return None
