"""Shared fixtures: the real engine and models, GGUF fixtures shaped like the examples, machine facts."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gguf_fixtures import DRAFT_06B, TARGET_27B, write_model

from appliance.facts.dialect import builtin_dialect
from appliance.facts.gguf import ModelInfo
from appliance.facts.gpu import GpuMemory
from appliance.facts.machine import MachineFacts
from appliance.facts.meminfo import HostMemory
from appliance.ops.models import GEMMA3, SMOLLM2
from appliance.plan.plan import Plan
from appliance.plan.resolved import Appliance, resolve
from appliance.plan.validate import validate
from appliance.render.apply import installed_spec_path
from appliance.spec.model import Spec
from appliance.system.users import account

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "etc" / "llm-appliance"
ENGINE_BINARY = Path(os.environ.get("LLAMA_SERVER", "/opt/llm-appliance/engine/bin/llama-server"))
MODELS_DIR = Path(os.environ.get("LLM_APPLIANCE_MODELS", "/var/lib/llm-appliance/models"))
INSTALLED_MODELS = "/var/lib/llm-appliance/models"
GIB = 1 << 30


def _require(path: Path, how: str) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: {how} (.ci/run does this)")
    return path


@pytest.fixture(scope="session", autouse=True)
def _llama_library() -> None:
    # llama-cpp-python is installed without its own build; it uses the engine's libllama (one llama.cpp).
    if "LLAMA_CPP_LIB_PATH" not in os.environ and (ENGINE_BINARY.parent / "libllama.so").exists():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(ENGINE_BINARY.resolve().parent)


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return _require(ENGINE_BINARY, "run `llm-appliance engine install`")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return _require(MODELS_DIR / SMOLLM2, f"run `llm-appliance models fetch --dest {MODELS_DIR}`")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return _require(MODELS_DIR / GEMMA3, f"run `llm-appliance models fetch --dest {MODELS_DIR}`")


@pytest.fixture(scope="session")
def fixture_models(outside_tmp: Path, smollm2: Path) -> Path:
    """A directory holding the demo's real model and the 27B/0.6B-shaped fixtures, as the examples name them;
    not in /tmp, which validate warns of (emptied at boot)."""
    directory = outside_tmp / "models"
    directory.mkdir(mode=0o755)
    write_model(directory / "target-27b-Q4_K_M.gguf", TARGET_27B, smollm2)
    write_model(directory / "draft-0.6b-Q4_K_M.gguf", DRAFT_06B, smollm2)
    (directory / SMOLLM2).symlink_to(smollm2)
    return directory


def resolved(spec_path: Path, facts: MachineFacts | None = None, **changes: object) -> Appliance:
    """The spec validated and resolved as apply resolves it; `changes` replace resolved fields (a port, the argv)."""
    appliance = resolve(validate(spec_path, facts=facts).plan, installed_spec_path(spec_path))
    return dataclasses.replace(appliance, **changes)  # type: ignore[arg-type]


def appliance_of(spec: Spec, **changes: object) -> Appliance:
    """A spec resolved without its model files (the daemon's logic tests): empty model headers, no budget."""

    def header(path: Path) -> ModelInfo:
        return ModelInfo(path, 0, {}, {}, ())

    draft = header(spec.models.draft.path) if spec.models.draft else None
    plan = Plan(spec, ("llama-server",), (), (), header(spec.models.target.path), draft)
    return dataclasses.replace(resolve(plan, Path("/etc/llm-appliance/test.toml")), **changes)  # type: ignore[arg-type]


def gpu_facts(*totals_gib: float, host_gib: float = 64) -> MachineFacts:
    """A machine with GPUs of these sizes and `host_gib` of RAM, the built-in flag dialect, no engine binary found."""
    gpus = tuple(
        GpuMemory(i, "NVIDIA GeForce RTX 4090", int(t * GIB), 0, int(t * GIB)) for i, t in enumerate(totals_gib)
    )
    return MachineFacts(
        gpus=gpus,
        nvml_error=None if gpus else "NVML: NVML Shared Library Not Found",
        binary=None,
        dialect=builtin_dialect(),
        dialect_note=None,
        host_memory=HostMemory(int(host_gib * GIB), int(host_gib * GIB) // 2),
    )


@pytest.fixture
def example(tmp_path: Path, fixture_models: Path) -> Callable[[str], Path]:
    """Copy an example spec next to the fixtures, its model paths pointing at them; same file name."""

    def copy(name: str, replace: dict[str, str] | None = None) -> Path:
        text = (EXAMPLES / name).read_text().replace(INSTALLED_MODELS, str(fixture_models))
        for old, new in (replace or {}).items():
            assert old in text, f"{old!r} not in {name}"
            text = text.replace(old, new)
        spec = tmp_path / name
        spec.write_text(text)
        return spec

    return copy


EXAMPLE_FACTS = {
    "appliance.toml": gpu_facts(24),
    "dual-gpu.toml": gpu_facts(24, 24),
    "demo.toml": gpu_facts(),
    "demo-draft.toml": gpu_facts(),
    "demo-fallback.toml": gpu_facts(),
}


KeyFile = Callable[..., Path]


@pytest.fixture(scope="session")
def key_file() -> Iterator[KeyFile]:
    """API key files as README says to make them: root:llm-appliance, mode 0640, one key per line, each in a
    fresh directory the service user may enter (pytest's own are 0700): validate checks them as the server
    will read them. `mode` and `group` (a gid) make wrong ones; `text` writes the file as given."""
    top = Path(tempfile.mkdtemp(prefix="llm-appliance-keys-", dir="/var/lib"))
    top.chmod(0o755)
    service = account()

    def make(
        *keys: str, name: str = "api-keys", mode: int = 0o640, group: int | None = None, text: str | None = None
    ) -> Path:
        directory = Path(tempfile.mkdtemp(dir=top))
        directory.chmod(0o755)
        path = directory / name
        path.write_text(text if text is not None else "".join(f"{key}\n" for key in keys))
        if os.geteuid() == 0:
            os.chown(path, 0, group if group is not None else service.gid if service else 0)
        path.chmod(mode)
        return path

    yield make
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="session")
def outside_tmp() -> Iterator[Path]:
    """A directory in neither /tmp nor a home: the units' sandbox binds nothing from here, so the service
    user's own way to a file (every directory on the way) is what counts."""
    top = Path(tempfile.mkdtemp(prefix="llm-appliance-test-", dir="/var/lib"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="session")
def home_dir() -> Iterator[Path]:
    """A directory in /home, which the units hide (ProtectHome=) and bind files back from."""
    top = Path(tempfile.mkdtemp(prefix="llm-appliance-test-", dir="/home"))
    # A home its owner lets others pass (o+x), as validate asks of a 0700 one (Debian 12's adduser makes them so):
    # the units bind a file alone, but `up` runs unsandboxed and must pass through every directory on the way.
    top.chmod(0o711)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def start_up(spec: Path, *options: str | Path, new_session: bool = False) -> tuple[subprocess.Popen[str], list[str]]:
    """`llm-appliance up SPEC OPTIONS` in the background; its output lines collect in the list as they come.
    `new_session`: in a process group of its own, as a shell runs a foreground job (Ctrl-C signals the group)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli.main", "up", str(spec), *map(str, options)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=new_session,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    return process, output


UpProcess = Callable[[Path], tuple[subprocess.Popen[str], list[str]]]


@pytest.fixture
def appliance_up(tmp_path: Path) -> Iterator[UpProcess]:
    """`llm-appliance up SPEC` in the background, its output collected; resumed and stopped at the end.

    With --as-current-user: these tests run as root with models and state in pytest's directories (0700,
    root's), which the service user `up` would become cannot read; tests/test_privileges.py runs `up` as root
    without it and checks that llama-server runs as the service user."""
    started: list[subprocess.Popen[str]] = []

    def start(spec: Path) -> tuple[subprocess.Popen[str], list[str]]:
        process, output = start_up(spec, "--state-dir", tmp_path / "state", "--stop-timeout", "5", "--as-current-user")
        started.append(process)
        return process, output

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


def service_settings(unit_text: str) -> dict[str, list[str]]:
    """A rendered unit's [Service] settings, each key with its values in order (a key may repeat)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in unit_text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@pytest.fixture
def engine_dir(outside_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """An engine tree of a test's own (the service user must reach its wrappers: not under /tmp)."""
    directory = outside_tmp / f"engine-{request.node.name[:40]}"
    (directory / "bin").mkdir(parents=True, mode=0o755)
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def spec_of(tmp_path: Path, smollm2: Path) -> Callable[..., Path]:
    """The demo spec with a binary of its own (and, optionally, a pinned engine rung)."""

    def make(binary: Path, rung: str | None = None) -> Path:
        text = (EXAMPLES / "demo.toml").read_text().replace("[server]\n", f'[server]\nbinary = "{binary}"\n', 1)
        text = text.replace(f"{INSTALLED_MODELS}/{SMOLLM2}", str(smollm2))
        if rung:
            text += f'\n[engine]\nrung = "{rung}"\n'
        spec = tmp_path / "demo.toml"
        spec.write_text(text)
        return spec

    return make
