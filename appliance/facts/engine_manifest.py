"""What the installed engine says it is: the manifest `llm-appliance engine install` writes beside it
(where the binary came from, its --version line, source and build options), read by `engine info` and by
the version checks."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
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
    build: str = ""  # the ladder's build variant ("native", "no-amx", "portable"); empty in manifests before it
    instruction_sets: list[str] = field(default_factory=list)  # ggml's x86 options compiled in (facts/cpu.py)

    @property
    def variant(self) -> str:
        """Which build this is: the ladder's variant, "installed" for a binary of the user's."""
        return self.build or ("native" if self.origin == "built" else "installed")

    def write(self, directory: Path) -> None:
        write_atomically(directory / MANIFEST, json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest | None:
        try:
            return cls(**json.loads((directory / MANIFEST).read_text()))
        except (OSError, ValueError, TypeError):
            return None
