"""Provision llama-server: the binary the user names, else one on PATH, else a build from a pinned source.

The source is llama.cpp as vendored by llama-cpp-python 0.3.36 on PyPI (the only registry reachable).
Only the `llama-server` and `llama` targets are built, with shared libraries beside the binary
($ORIGIN rpath), so the same libllama serves llama-cpp-python's vocabulary reads: one llama.cpp commit.
Builds are cached under the cache directory by source and options; a second install takes seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.facts.cpu import AMX, INSTRUCTION_SETS, PORTABLE, Cpu, read_cpu
from appliance.facts.engine_manifest import Manifest
from appliance.facts.engine_record import RECORD, RUNG_BUILD, EngineRecord, fingerprint_of
from appliance.system import paths
from appliance.system.files import write_atomically
from appliance.system.run import CommandFailed, run, stream

CACHE_DIR = Path(os.environ.get("LLM_APPLIANCE_CACHE", "/var/cache/llm-appliance"))


@dataclass(frozen=True)
class Source:
    package: str
    version: str
    sha256: str
    llama_cpp_commit: str
    llama_cpp_version: str

    @property
    def sdist(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}.tar.gz"


PINNED = Source(
    "llama-cpp-python",
    "0.3.36",
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "0c1e570",
    "0.5.0-dev",
)


class EngineError(Exception):
    """Provisioning failed; the message says which step and what to do."""


def backend() -> str:
    """CUDA when a whole CUDA toolkit is here (nvcc and cuBLAS), CPU otherwise; LLM_APPLIANCE_BACKEND overrides."""
    chosen = os.environ.get("LLM_APPLIANCE_BACKEND")
    if chosen in ("cpu", "cuda"):
        return chosen
    nvcc = shutil.which("nvcc")
    # Some images ship nvcc without the CUDA math libraries; a CUDA build would fail late.
    toolkit = Path(nvcc).resolve().parent.parent if nvcc else None
    return "cuda" if toolkit and (toolkit / "include" / "cublas_v2.h").exists() else "cpu"


def build_options(kind: str, variant: str = "native", cpu: Cpu | None = None) -> list[str]:
    """CMake's options for a build: `variant` is the ladder's (facts/engine_record.py RUNG_BUILD): "native"
    compiles for this machine's CPU (`-march=native`), "no-amx" for its instruction sets less AMX, "portable"
    for any x86-64-v2 CPU. The last two name every instruction set, so what is compiled in is what is listed."""
    options = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the binary finds its libraries wherever it is copied
        "-DGGML_NATIVE=ON" if variant == "native" else "-DGGML_NATIVE=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would fetch the web UI at configure time
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_NUMBER=1",
        f"-DLLAMA_BUILD_COMMIT={PINNED.llama_cpp_commit}",
    ]
    if variant != "native":
        chosen = variant_instruction_sets(variant, cpu or read_cpu())
        options += [f"-D{s.option}={'ON' if s.option in chosen else 'OFF'}" for s in INSTRUCTION_SETS]
    if kind == "cuda":
        options += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native"]
    return options


def variant_instruction_sets(variant: str, cpu: Cpu) -> tuple[str, ...]:
    """The x86 instruction sets a build variant compiles in (native: all of this CPU's, as -march=native does)."""
    if variant == "no-amx":
        return tuple(option for option in cpu.instruction_sets if option not in AMX)
    if variant == "portable":
        return tuple(option for option in cpu.instruction_sets if option in PORTABLE)
    return cpu.instruction_sets


def options_key(kind: str, variant: str = "native", cpu: Cpu | None = None) -> str:
    return hashlib.sha256("\n".join(build_options(kind, variant, cpu)).encode()).hexdigest()[:12]


def log(message: str) -> None:
    print(f"engine: {message}", file=sys.stderr, flush=True)


def version_line(binary: Path) -> str:
    try:
        # Quiet: a probe; what it printed is judged here, with the exit code.
        result = run([binary, "--version"], timeout=30, check=False, quiet=True)
    except CommandFailed as exc:
        raise EngineError(f"{binary} --version failed: {exc}") from None
    text = (result.stdout + result.stderr).strip()
    match = re.search(r"version: .*", text)
    if result.returncode != 0 or not match:
        raise EngineError(f"{binary} --version failed (exit {result.returncode}): {text[-400:]}")
    return match.group(0)


def fetch_source(cache: Path) -> Path:
    """Download and unpack the pinned sdist (verified by sha256); return the llama.cpp tree."""
    src = cache / "src"
    tree = src / f"{PINNED.package.replace('-', '_')}-{PINNED.version}"
    if (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return tree / "vendor" / "llama.cpp"
    src.mkdir(parents=True, exist_ok=True)
    archive = src / PINNED.sdist
    if not archive.is_file():
        log(f"downloading {PINNED.package}=={PINNED.version} (source of llama.cpp {PINNED.llama_cpp_commit}) from PyPI")
        # Only the package itself as source: with `--no-binary :all:` pip would first compile its own build
        # tools (setuptools, hatchling, scikit-build-core) from source to read the sdist's metadata.
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                PINNED.package,
                "--quiet",
                "-d",
                str(src),
                f"{PINNED.package}=={PINNED.version}",
            ],
            "download the source",
        )
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != PINNED.sha256:
        archive.unlink()
        raise EngineError(
            f"{archive.name} has sha256 {digest}, expected {PINNED.sha256}; deleted it, run the install again"
        )
    log(f"unpacking {archive.name}")
    staging = src / (tree.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as sdist:
        sdist.extractall(staging, members=safe_members(sdist, staging))
    shutil.rmtree(tree, ignore_errors=True)
    (staging / tree.name).rename(tree)
    staging.rmdir()
    return tree / "vendor" / "llama.cpp"


def safe_members(archive: tarfile.TarFile, into: Path) -> list[tarfile.TarInfo]:
    """Regular files, directories and links that stay inside `into`, without set-id bits: what
    `filter="data"` does on Python 3.11.4+, checked by hand because Debian 12's python3 is 3.11.2."""
    root = into.resolve()
    source = Path(os.fsdecode(archive.name or "the archive")).name
    members = []
    for member in archive.getmembers():
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise EngineError(f"{source}: {member.name} is a device or fifo; refusing to unpack it")
        target = (root / member.name).resolve()
        if member.issym():
            link = (target.parent / member.linkname).resolve()
        elif member.islnk():
            link = (root / member.linkname).resolve()
        else:
            link = target
        if Path(member.name).is_absolute() or not all(p.is_relative_to(root) for p in (target, link)):
            raise EngineError(f"{source}: {member.name} points outside the archive; refusing to unpack it")
        member.mode &= 0o755
        member.uid = member.gid = 0
        member.uname = member.gname = "root"
        members.append(member)
    return members


def build(cache: Path, kind: str, jobs: int | None = None, variant: str = "native") -> Path:
    """Configure and build llama-server; returns the build's bin/ directory. Incremental when cached; each
    variant has a build directory of its own, so the ladder's rebuilds cost one compile each, once."""
    source = fetch_source(cache)
    suffix = "" if variant == "native" else f"-{variant}"
    build_dir = cache / "engine" / "build" / f"{PINNED.package}-{PINNED.version}-{kind}{suffix}"
    options = build_options(kind, variant)
    if (not (build_dir / "build.ninja").exists() and not (build_dir / "Makefile").exists()) or _options_changed(
        build_dir, options
    ):
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"configuring ({kind}{', ' + variant if variant != 'native' else ''}) in {build_dir}")
        _run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *options], "configure llama.cpp (cmake)")
        write_atomically(build_dir / "llm-appliance-options.txt", "\n".join(options) + "\n")
    jobs = jobs or os.cpu_count() or 2
    log(f"building llama-server with {jobs} jobs (a first CPU build took 7 minutes on 2 cores here; CUDA takes longer)")
    _run_with_progress(["cmake", "--build", str(build_dir), "--target", "llama-server", "llama", "-j", str(jobs)])
    return build_dir / "bin"


def _options_changed(build_dir: Path, options: list[str]) -> bool:
    recorded = build_dir / "llm-appliance-options.txt"
    return not recorded.is_file() or recorded.read_text().split() != options


def install_built(bin_dir: Path, dest: Path, kind: str, variant: str = "native") -> Manifest:
    """Copy the binary and its libraries into dest atomically (staging dir + rename)."""
    staging = dest.with_name(dest.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "bin").mkdir(parents=True)
    for item in sorted(bin_dir.iterdir()):
        if item.name == "llama-server" or (item.name.startswith("lib") and ".so" in item.name):
            shutil.copy2(item, staging / "bin" / item.name, follow_symlinks=False)
    # The proof of the engine this replaces is not a proof of this one; the ladder's record survives a rebuild
    # of its own rung only through `engine prove` (the fingerprint says the files changed).
    if (dest / RECORD).is_file():
        shutil.copy2(dest / RECORD, staging / RECORD)
    binary = paths.engine_binary(staging)
    manifest = Manifest(
        binary=str(paths.engine_binary(dest)),
        origin="built",
        version_line=version_line(binary),
        source={**asdict(PINNED), "options_key": options_key(kind, variant)},
        backends=["CPU", "CUDA"] if kind == "cuda" else ["CPU"],
        build_options=build_options(kind, variant),
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        build=variant,
        instruction_sets=list(variant_instruction_sets(variant, read_cpu())),
    )
    manifest.write(staging)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return manifest


def install(
    dest: Path = paths.ENGINE_DIR,
    cache: Path = CACHE_DIR,
    binary: str | None = None,
    jobs: int | None = None,
    variant: str | None = None,
) -> Manifest:
    """`llm-appliance engine install`: the named binary, else one on PATH, else the pinned build (the variant
    the engine's proof chose on this CPU, else native)."""
    try:
        return _install(dest, cache, binary, jobs, variant)
    except OSError as exc:
        where = exc.filename or dest
        raise EngineError(
            f"cannot write {where}: {exc.strerror or exc}; run as root or choose a writable --dest"
        ) from None


def _install(dest: Path, cache: Path, binary: str | None, jobs: int | None, variant: str | None) -> Manifest:
    named = binary or os.environ.get("LLAMA_SERVER")
    origin = "user" if named else "path"
    found = Path(named) if named else (Path(p) if (p := shutil.which("llama-server")) else None)
    if found is not None and found.resolve() != paths.engine_binary(dest).resolve():
        if not os.access(found, os.X_OK):
            raise EngineError(f"{found} is not an executable file; fix server.binary or LLAMA_SERVER")
        manifest = Manifest(
            str(found), origin, version_line(found), None, [], [], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        )
        dest.mkdir(parents=True, exist_ok=True)
        manifest.write(dest)
        log(f"using {found} ({manifest.version_line}); nothing built")
        return manifest
    kind = backend()
    current = Manifest.read(dest)
    variant = variant or chosen_variant(dest, current)
    if (
        current
        and current.origin == "built"
        and current.source
        and current.source.get("options_key") == options_key(kind, variant)
        and current.source.get("sha256") == PINNED.sha256
        and Path(current.binary).is_file()
    ):
        if not current.build:  # a manifest from before the ladder: say which build and instruction sets it is
            current = dataclasses.replace(
                current, build=variant, instruction_sets=list(variant_instruction_sets(variant, read_cpu()))
            )
            current.write(dest)
        log(f"{current.binary} is up to date ({current.version_line}, {variant} build)")
        return current
    manifest = install_built(build(cache, kind, jobs, variant), dest, kind, variant)
    log(f"installed {manifest.binary} ({manifest.version_line}, {variant} build)")
    return manifest


def chosen_variant(dest: Path, current: Manifest | None) -> str:
    """The build the engine's proof settled on for this CPU, so that a reinstall keeps the ladder's choice;
    native where nothing was proven, or the proof was on another CPU."""
    record = EngineRecord.read(dest / RECORD)
    if record is None or current is None or current.origin != "built":
        return "native"
    here = fingerprint_of(Path(current.binary), current.version_line, current.variant, read_cpu())
    same_cpu = here.cpu_flags_digest == record.fingerprint.cpu_flags_digest
    return RUNG_BUILD[record.rung] if same_cpu else "native"


class EngineBuilds:
    """The ladder's builds on this machine (ops/engine_proof.Builds): each variant built once into the cache,
    proven from there, installed as the engine when it is kept."""

    def __init__(self, dest: Path = paths.ENGINE_DIR, cache: Path = CACHE_DIR, jobs: int | None = None) -> None:
        self.dest, self.cache, self.jobs, self.kind = dest, cache, jobs, backend()

    def binary(self, variant: str) -> Path | None:
        return build(self.cache, self.kind, self.jobs, variant) / "llama-server"

    def install(self, variant: str) -> Manifest:
        manifest = install_built(build(self.cache, self.kind, self.jobs, variant), self.dest, self.kind, variant)
        log(f"installed the {variant} build as {manifest.binary}")
        return manifest


def _run(argv: list[str], step: str) -> None:
    try:
        run(argv)
    except CommandFailed as exc:
        raise EngineError(f"could not {step}: {exc}") from None


def _run_with_progress(argv: list[str]) -> None:
    """Stream the build, printing a progress line every few percent so a user sees it is alive."""
    last_shown = -10

    def progress(line: str) -> None:
        nonlocal last_shown
        if match := re.match(r"\[(\d+)/(\d+)\]", line):
            percent = 100 * int(match.group(1)) // int(match.group(2))
            if percent >= last_shown + 5 or percent == 100:
                last_shown = percent
                log(f"build {percent:3d}% {line.split(']', 1)[1].strip()[:90]}")

    try:
        stream(argv, progress)
    except CommandFailed as exc:
        raise EngineError(f"the llama-server build failed: {exc}") from None
