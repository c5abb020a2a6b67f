"""Facts about the machine the spec will run on, gathered once and passed to planning.

Planning is pure: tests build a MachineFacts of their own instead of probing this machine.
"""

from __future__ import annotations

import os
import pwd
import shutil
from dataclasses import dataclass
from pathlib import Path

from appliance.facts.dialect import Dialect, builtin_dialect, read_binary_dialect
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import EngineRecord, record_file, stale_reason
from appliance.facts.gpu import GpuMemory, Nvml, NvmlUnavailable, Pynvml
from appliance.facts.meminfo import MEMINFO, HostMemory, MeminfoError, read_meminfo
from appliance.spec.base import DEFAULT_BINARY
from appliance.spec.model import Spec
from appliance.system import paths
from appliance.system.run import CommandFailed
from appliance.system.users import Account, NoServiceUser, account, runs_as, trusted_status


@dataclass(frozen=True)
class MachineFacts:
    gpus: tuple[GpuMemory, ...]
    nvml_error: str | None
    binary: Path | None  # the llama-server that will run, when found
    dialect: Dialect
    dialect_note: str | None  # why the built-in dialect was used, when it was
    host_memory: HostMemory | None = None  # the machine's RAM; None when it cannot be read
    host_memory_error: str | None = None  # why it cannot
    router_missing: str | None = None  # [fallback]: what the router needs and this machine lacks
    engine: EngineRecord | None = None  # the proof of `binary` on this machine, and the rung it serves from
    engine_stale: str | None = None  # why `binary` must be proven (again) before it serves; None: it is proven
    # Why the service user could change what `binary` runs (it, its libraries, a directory on the way): such an
    # engine is not run, not even its --help; None: it cannot.
    binary_untrusted: str | None = None

    def gpu(self, device: str) -> GpuMemory | None:
        return next((g for g in self.gpus if g.device == device), None)


def find_binary(spec: Spec) -> Path | None:
    """The spec's binary, else $LLAMA_SERVER, else llama-server on PATH."""
    candidates = [spec.server.binary]
    if spec.server.binary == DEFAULT_BINARY:
        candidates += [os.environ.get("LLAMA_SERVER", ""), shutil.which("llama-server") or ""]
    for candidate in candidates:
        # "\0" in a path makes os.access raise ValueError; such a file cannot exist.
        if candidate and "\0" not in candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return Path(candidate)
    return None


def untrusted_engine(binary: Path, who: Account) -> str | None:
    """Why `who` could change what running `binary` runs, or None: the binary (as named and as its links lead),
    every library beside it or in its ../lib (where its RUNPATH and llama-cpp-python look), and every directory
    on the way to them, each by users.trusted_status."""
    real = binary.resolve()
    found = [binary, real]
    for directory in (real.parent, real.parent.parent / "lib"):
        if directory.is_dir():
            found += sorted(p for p in directory.iterdir() if ".so" in p.name)
    for path in dict.fromkeys(found):
        try:
            reason = trusted_status(path, who)
        except OSError as exc:
            reason = f"cannot check {path}: {exc.strerror}"
        if reason:
            return reason
    return None


def router_missing(venv: Path = paths.ROUTER_VENV, user: str = paths.ROUTER_USER) -> str | None:
    """What the router unit needs on this machine and does not find: its virtualenv, its user."""
    missing = []
    if not (venv / "bin" / "litellm").is_file():
        missing.append(f"its virtualenv {venv} (LiteLLM's proxy)")
    try:
        pwd.getpwnam(user)
    except KeyError:
        missing.append(f"its user {user}")
    return " and ".join(missing) or None


def gather(spec: Spec, nvml: Nvml | None = None, meminfo: Path = MEMINFO) -> MachineFacts:
    nvml = nvml or Pynvml()
    gpus: tuple[GpuMemory, ...] = ()
    nvml_error = None
    try:
        gpus = tuple(nvml.gpus())
    except NvmlUnavailable as exc:
        nvml_error = str(exc)
    binary = find_binary(spec)
    note, untrusted = None, None
    service = account()
    if binary is not None and service is not None:
        untrusted = untrusted_engine(binary, service)
    if binary is None:
        dialect = builtin_dialect()
        note = f"{spec.server.binary} not found; planned with the flags of the llama.cpp this release builds"
    elif untrusted:
        dialect = builtin_dialect()
    else:
        try:
            dialect = read_binary_dialect(binary, runs_as())
        except (OSError, CommandFailed, NoServiceUser) as exc:
            dialect = builtin_dialect()
            note = f"{binary} --help failed ({exc}); planned with the built-in dialect"
    host_memory, host_memory_error = None, None
    try:
        host_memory = read_meminfo(meminfo)
    except MeminfoError as exc:
        host_memory_error = str(exc)
    router = router_missing() if spec.fallback is not None else None
    engine, engine_stale = proof_of(binary, spec.engine.rung, nvml) if binary else (None, None)
    return MachineFacts(
        gpus,
        nvml_error,
        binary,
        dialect,
        note,
        host_memory,
        host_memory_error,
        router,
        engine,
        engine_stale,
        untrusted,
    )


def proof_of(
    binary: Path, pin: str, nvml: Nvml, engine_dir: Path = paths.ENGINE_DIR
) -> tuple[EngineRecord | None, str | None]:
    """The engine record of `binary` (its rung's flags go into the argv), and why it must be proven first."""
    record = EngineRecord.read(record_file(binary, engine_dir))
    manifest = Manifest.read(engine_dir)
    manifest = manifest if manifest is not None and Path(manifest.binary) == binary else None
    return record, stale_reason(binary, record, manifest, pin, nvml)
