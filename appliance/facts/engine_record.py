"""The engine as proven on this machine: its fingerprint (what its speed and its very ability to run depend on),
the rung of the ladder it serves from, and what its proof measured.

`llm-appliance engine prove` writes the record beside the engine (root's, like the engine); planning reads it to
add the rung's flags to the argv, `explain`, `status` and `engine info` show it, and every start checks that
the fingerprint still holds: a new kernel, CPU, driver or build is an engine not yet proven here.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from appliance.facts.contention import CONTENDED_SHARE
from appliance.facts.cpu import Cpu, read_cpu
from appliance.facts.engine_manifest import Manifest
from appliance.facts.gpu import Nvml, NvmlUnavailable, Pynvml
from appliance.system.files import write_atomically

RECORD = "proof.json"
Rung = Literal["as-built", "no-repack", "no-amx", "portable"]
# The ladder, top down: the engine as built, the same binary without ggml's extra buffer types (AMX, repacked
# kernels), a rebuild for this CPU's instruction sets less AMX, a build for any x86-64-v2 CPU.
RUNGS: tuple[Rung, ...] = ("as-built", "no-repack", "no-amx", "portable")
RUNG_ARGS: dict[Rung, tuple[str, ...]] = {"no-repack": ("--no-repack",)}
# Which build each rung runs: the rungs that share a build share its binary.
RUNG_BUILD: dict[Rung, str] = {"as-built": "native", "no-repack": "native", "no-amx": "no-amx", "portable": "portable"}
RUNG_MEANING: dict[Rung, str] = {
    "as-built": "the engine as built",
    "no-repack": "the same binary with --no-repack (no AMX or repacked CPU kernels)",
    "no-amx": "a rebuild for this CPU's instruction sets less AMX",
    "portable": "a portable build (x86-64-v2: SSE4.2, no AVX)",
}


# Fingerprint fields a record may lack, written before they existed.
ADDED_LATER = frozenset({"bindings"})


@dataclass(frozen=True)
class Fingerprint:
    """What a proof holds for: the same engine files on the same CPU, kernel and GPU driver."""

    engine_digest: str  # sha256 of llama-server and the libraries beside it
    version_line: str
    build: str  # "native", "no-amx", "portable" (the ladder's builds) or "installed" (a binary of the user's)
    cpu_model: str
    cpu_flags_digest: str  # sha256 of /proc/cpuinfo's flags: a moved disk image lands on another CPU
    kernel: str
    driver: str = ""  # NVIDIA driver and CUDA (NVML), where a GPU is
    cuda: str = ""
    gpus: str = ""  # the GPUs' models, as NVML names them
    bindings: str = ""  # llama-cpp-python's version: the vocabulary reads go through it

    def changes_from(self, old: Fingerprint) -> list[str]:
        """What differs from `old`, as an operator reads it ("kernel 6.1.0-18 -> 6.1.0-21")."""
        shown = {
            "engine_digest": "engine files",
            "version_line": "engine",
            "build": "engine build",
            "cpu_model": "CPU",
            "cpu_flags_digest": "CPU flags",
            "kernel": "kernel",
            "driver": "driver",
            "cuda": "CUDA",
            "gpus": "GPUs",
            "bindings": "llama-cpp-python",
        }
        found = []
        for name, label in shown.items():
            before, after = getattr(old, name), getattr(self, name)
            if name in ADDED_LATER and not before:
                continue  # a record from before the field: it was not measured, not different
            if before != after:
                digest = name.endswith("_digest")
                found.append(
                    f"{label} {before[:12] if digest else before or '-'} -> {after[:12] if digest else after or '-'}"
                )
        return found


@dataclass(frozen=True)
class Trial:
    """One rung's proof: it answered (and how fast), or how it failed."""

    rung: Rung
    passed: bool
    decode_tps: float = 0.0
    prompt_tps: float = 0.0
    failure: str = ""  # the failure as an operator reads it (runtime/server_death.py)
    output_sha256: str = ""  # the greedy answer's: a build that answers differently shows
    contended: float = 0.0  # the share of the CPUs other processes took while it was measured

    def summary(self) -> str:
        if self.passed:
            return f"{self.rung}: answered, decode {self.decode_tps:.1f} tok/s, prompt {self.prompt_tps:.1f} tok/s"
        return f"{self.rung}: {self.failure}"


@dataclass(frozen=True)
class Measured:
    """What the engine proven before a change measured: the figures a change is judged against."""

    fingerprint: Fingerprint
    decode_tps: float
    prompt_tps: float
    output_sha256: str
    proven_at: str


@dataclass(frozen=True)
class EngineRecord:
    fingerprint: Fingerprint
    rung: Rung
    reason: str  # why this rung: "proven as built", or the ladder's story
    trials: tuple[Trial, ...]  # every rung tried, in order
    proof_argv: tuple[str, ...]  # the command line proven (the spec's, on a loopback port of its own)
    proven_at: str
    pinned: bool = False  # the spec's engine.rung chose it, not the ladder
    # What the CPU could run, as its proof saw it: inside the units' sandbox /proc/cpuinfo is hidden.
    cpu_instruction_sets: tuple[str, ...] = ()
    previous: Measured | None = None  # the engine before the last change of the fingerprint, as it measured
    changed: tuple[str, ...] = ()  # what changed since `previous` ("driver 550.54 -> 560.28")
    extra: dict[str, Any] = field(default_factory=dict)  # room for later figures (bench), kept as read

    @property
    def extra_args(self) -> tuple[str, ...]:
        """The flags this rung adds to every llama-server command line."""
        return RUNG_ARGS.get(self.rung, ())

    @property
    def kept(self) -> Trial:
        return next(t for t in reversed(self.trials) if t.rung == self.rung and t.passed)

    @property
    def regression_ratio(self) -> float | None:
        """Decode now over decode before the change, the same greedy prompt on the same machine; None when
        nothing changed, or either figure was measured while other processes took the CPUs."""
        before = self.previous
        if before is None or before.decode_tps <= 0 or self.kept.decode_tps <= 0:
            return None
        if self.kept.contended > CONTENDED_SHARE:
            return None
        return round(self.kept.decode_tps / before.decode_tps, 3)

    @property
    def answers_differently(self) -> bool:
        return self.previous is not None and self.previous.output_sha256 != self.kept.output_sha256

    def change_summary(self) -> str:
        """ "driver 550.54 -> 560.28: decode 159 -> 40 tok/s, 0.25x": what changed and what it did to decode."""
        if self.previous is None:
            return ""
        ratio = self.regression_ratio
        figure = (
            f"{ratio:.2f}x" if ratio is not None else f"not judged: the CPUs were shared ({self.kept.contended:.0%})"
        )
        answers = "; the greedy answer changed" if self.answers_differently else ""
        what = "; ".join(self.changed) or "the engine was proven again"
        return f"{what}: decode {self.previous.decode_tps:.0f} -> {self.kept.decode_tps:.0f} tok/s, {figure}{answers}"

    def write(self, path: Path) -> None:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomically(path, json.dumps(asdict(self), indent=2, sort_keys=True) + "\n", mode=0o644)

    @classmethod
    def read(cls, path: Path) -> EngineRecord | None:
        """The record, or None when there is none or it is not one (an older format: prove again)."""
        try:
            document = json.loads(path.read_text())
            document["fingerprint"] = Fingerprint(**document["fingerprint"])
            document["trials"] = tuple(Trial(**t) for t in document["trials"])
            document["proof_argv"] = tuple(document["proof_argv"])
            document["cpu_instruction_sets"] = tuple(document.get("cpu_instruction_sets", ()))
            document["changed"] = tuple(document.get("changed", ()))
            if document.get("previous"):
                before = document["previous"]
                document["previous"] = Measured(**{**before, "fingerprint": Fingerprint(**before["fingerprint"])})
            known = {f.name for f in fields(cls)}
            record = cls(**{k: v for k, v in document.items() if k in known})
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return record if record.rung in RUNGS and any(t.passed for t in record.trials) else None


def record_file(binary: Path, engine_dir: Path) -> Path:
    """Where the proof of `binary` is kept: beside the engine for the engine's own, under proofs/ for a binary
    of the user's (each its own: proving one never overwrites another's)."""
    if binary == engine_dir / "bin" / "llama-server":
        return engine_dir / RECORD
    return engine_dir / "proofs" / f"{hashlib.sha256(str(binary).encode()).hexdigest()[:16]}.json"


def engine_digest(binary: Path) -> str:
    """sha256 over llama-server and every shared library beside it, by name: what a rebuild changes."""
    digest = hashlib.sha256()
    directory = binary.parent
    try:
        files = [binary, *sorted(p for p in directory.iterdir() if p.name.startswith("lib") and ".so" in p.name)]
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    except OSError:
        return ""
    return digest.hexdigest()


def fingerprint_of(
    binary: Path, version_line: str, build: str, cpu: Cpu, driver: str = "", cuda: str = ""
) -> Fingerprint:
    return Fingerprint(
        engine_digest=engine_digest(binary),
        version_line=version_line,
        build=build,
        cpu_model=cpu.model,
        cpu_flags_digest=hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest(),
        kernel=os.uname().release,
        driver=driver,
        cuda=cuda,
    )


def current_fingerprint(
    binary: Path, manifest: Manifest | None, cpu: Cpu | None = None, nvml: Nvml | None = None
) -> Fingerprint:
    """What the engine that would run now is, on this machine."""
    driver = cuda = gpus = ""
    nvml = nvml or Pynvml()
    with contextlib.suppress(NvmlUnavailable):
        driver, cuda = nvml.driver_version(), nvml.cuda_version()
        gpus = ", ".join(gpu.name for gpu in nvml.gpus())
    found = fingerprint_of(
        binary,
        manifest.version_line if manifest else "",
        manifest.variant if manifest else "installed",
        cpu or read_cpu(),
        driver,
        cuda,
    )
    try:
        bindings = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        bindings = ""
    return replace(found, gpus=gpus, bindings=bindings)


def stale_reason(
    binary: Path, record: EngineRecord | None, manifest: Manifest | None, pin: str = "auto", nvml: Nvml | None = None
) -> str | None:
    """Why the engine at `binary` needs a proof before it serves; None when its record holds."""
    why = stale(record, current_fingerprint(binary, manifest, nvml=nvml), binary)
    if why is None and record is not None and pin != "auto" and record.rung != pin:
        return f"the spec pins engine.rung = {pin!r} and the proven rung is {record.rung!r}"
    return why


def stale(record: EngineRecord | None, current: Fingerprint, binary: Path) -> str | None:
    """Why the record does not prove the engine that would run now; None when it does."""
    if record is None:
        return "it has not been proven on this machine"
    if record.proof_argv and Path(record.proof_argv[0]) != binary:
        return f"the proof was of {record.proof_argv[0]}, not {binary}"
    changed = current.changes_from(record.fingerprint)
    return f"it changed since its proof ({'; '.join(changed)})" if changed else None


def age(stamp: str, now: float | None = None) -> str:
    """How long ago a record's UTC time stamp was, as a person says it: 40 s, 12 min, 3 h, 5 d."""
    try:
        then = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return "an unknown time"
    seconds = max(0, int((time.time() if now is None else now) - then))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def engine_lines(record: EngineRecord | None, stale: str | None = None) -> list[str]:
    """What `engine info`, `explain` and `status` say of the engine's proof on this machine."""
    if record is None:
        return [f"engine proof: none on this machine ({stale or 'not proven'}); apply, up and install prove it"]
    kept = record.kept
    found = [
        f"engine rung: {record.rung}{' (pinned by engine.rung)' if record.pinned else ''}, proven {record.proven_at} "
        f"({age(record.proven_at)} ago): decode {kept.decode_tps:.1f} tok/s, prompt {kept.prompt_tps:.1f} tok/s",
        f"  why: {record.reason}",
    ]
    if record.previous is not None:
        found.append(f"  since the engine before ({record.previous.proven_at}): {record.change_summary()}")
    if record.extra_args:
        found.append(f"  adds to the llama-server argv: {' '.join(record.extra_args)}")
    found += [f"  tried {trial.summary()}" for trial in record.trials]
    if stale:
        found.append(f"  NOT PROVEN NOW: {stale}; the next apply, up or server start proves it again")
    return found
