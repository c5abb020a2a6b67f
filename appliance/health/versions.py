"""Driver, CUDA and llama.cpp versions: what runs, what the spec pins, what the baseline was measured under.

A driver or CUDA library upgrade can cut throughput to a third with no error anywhere; pinning the
known-good versions, and noticing when they change under a running box, is the only defence.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from appliance.facts.engine_manifest import Manifest
from appliance.facts.gpu import Nvml, NvmlUnavailable
from appliance.spec.model import Versions as Pins


@dataclass(frozen=True)
class Found:
    driver: str | None
    cuda: str | None
    llama_cpp: str | None  # the engine's `--version` line
    llama_cpp_python: str | None
    nvml_error: str | None = None
    nvml_mismatch: bool = False

    def comparable(self) -> dict[str, str | None]:
        """The versions a decode baseline depends on."""
        return {"driver": self.driver, "cuda": self.cuda, "llama_cpp": self.llama_cpp}


def detect(nvml: Nvml, engine_dir: Path) -> Found:
    driver = cuda = error = None
    mismatch = False
    try:
        driver, cuda = nvml.driver_version(), nvml.cuda_version()
    except NvmlUnavailable as exc:
        error, mismatch = str(exc), exc.mismatch
    manifest = Manifest.read(engine_dir)
    try:
        bindings: str | None = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        bindings = None
    return Found(driver, cuda, manifest.version_line if manifest else None, bindings, error, mismatch)


def mismatches(pins: Pins, found: Found) -> list[str]:
    """Each pin the machine does not meet, in words an admin can act on."""
    problems = []
    if found.nvml_mismatch:
        problems.append(found.nvml_error or "NVML: Driver/library version mismatch")
    for name, pinned, actual in (("driver", pins.driver, found.driver), ("cuda", pins.cuda, found.cuda)):
        if not pinned:
            continue
        if actual is None:
            problems.append(
                f"versions.{name} pins {pinned} but it cannot be read here ({found.nvml_error or 'no NVML'})"
            )
        elif not _matches(actual, pinned):
            problems.append(f"NVIDIA {name} is {actual}, the spec pins {pinned}")
    if pins.llama_cpp:
        if found.llama_cpp is None:
            problems.append(
                f"versions.llama_cpp pins {pins.llama_cpp} but no engine manifest was found (llm-appliance engine install)"
            )
        elif pins.llama_cpp not in found.llama_cpp:
            problems.append(f"llama-server is `{found.llama_cpp}`, the spec pins {pins.llama_cpp}")
    return problems


def _matches(actual: str, pinned: str) -> bool:
    # A pin of "550" or "550.54" matches 550.54.14; a full version must match exactly.
    return actual == pinned or actual.startswith(pinned + ".")


@dataclass(frozen=True)
class Baseline:
    decode_tps: dict[str, float]
    versions: dict[str, str | None]
    measured_at: str
    # The same buckets decoded without speculation: what the daemon's speedup is measured against. Files written
    # before it existed have none, and still read.
    no_speculation_tps: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Baseline | None:
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return cls(
                {str(k): float(v) for k, v in data["decode_tps"].items()},
                dict(data["versions"]),
                str(data["measured_at"]),
                {str(k): float(v) for k, v in data.get("no_speculation_tps", {}).items()},
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def drift(baseline_versions: dict[str, str | None], found: Found) -> list[str]:
    """What changed since the baseline was recorded (a driver upgraded under a running box).

    A version that cannot be read (NVML down now, or when the baseline was taken) is unknown, not changed."""
    now = found.comparable()
    return [
        f"{name}: {baseline_versions.get(name)} -> {now[name]}"
        for name in now
        if None not in (baseline_versions.get(name), now[name]) and baseline_versions.get(name) != now[name]
    ]
