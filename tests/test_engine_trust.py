"""Root runs nothing of the engine's (issue 36, High 4): an engine the service user could change is not run at
all, and the probes of one it cannot (`--help`, llama.cpp's loader on the model files) run as the service user."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.facts.machine import untrusted_engine
from appliance.facts.vocab import VocabUnavailable, read_vocab
from appliance.plan.validate import validate
from appliance.spec.problems import SpecInvalid
from appliance.system.users import Account, account

pytestmark = [pytest.mark.engine]
SERVICE = account()
if os.geteuid() != 0 or SERVICE is None:
    pytest.skip("needs root and the llm-appliance user (install.sh creates it)", allow_module_level=True)
assert SERVICE is not None


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A root-owned 0755 directory outside /tmp, for engines and their marks."""
    top = Path(tempfile.mkdtemp(prefix="llm-appliance-trust-", dir="/var/lib"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _engine(directory: Path, mark: Path, owner: Account | None = None) -> Path:
    """A llama-server that writes the uid it runs as to `mark`, then is the real one."""
    directory.mkdir(mode=0o755, exist_ok=True)
    binary = directory / "llama-server"
    binary.write_text(f'#!/bin/sh\nid -u >> {mark}\nexec /opt/llm-appliance/engine/bin/llama-server "$@"\n')
    binary.chmod(0o755)
    if owner is not None:
        os.chown(directory, owner.uid, owner.gid)
        os.chown(binary, owner.uid, owner.gid)
    return binary


def _marks(scratch: Path) -> Path:
    """Where engines write whom they ran as: the service user's, so they can when they run as it."""
    marks = scratch / "marks"
    marks.mkdir(mode=0o755)
    assert SERVICE is not None
    os.chown(marks, SERVICE.uid, SERVICE.gid)
    return marks / "ran-as"


def test_validate_as_root_refuses_an_engine_the_service_user_can_replace(
    example: Callable[..., Path], scratch: Path
) -> None:
    mark = _marks(scratch)
    binary = _engine(scratch / "theirs", mark, owner=SERVICE)
    spec = example("demo-draft.toml", {"[server]\n": f'[server]\nbinary = "{binary}"\n'})
    with pytest.raises(SpecInvalid) as caught:
        validate(spec)
    (problem,) = [p for p in caught.value.errors if p.field == "server.binary"]
    assert f"{scratch / 'theirs'} belongs to llm-appliance" in problem.message
    assert "not run, not even its --help" in problem.message
    assert "engine install" in problem.fix and "chmod go-w" in problem.fix
    assert problem.line is not None  # located at the binary line
    assert not mark.exists()  # it never ran: not as root, not as anyone


def test_a_library_beside_the_engine_that_the_service_user_owns_taints_it(scratch: Path) -> None:
    assert SERVICE is not None
    binary = _engine(scratch / "engine", scratch / "unused")
    library = scratch / "engine" / "libllama.so"
    library.write_bytes(b"")
    os.chown(library, SERVICE.uid, SERVICE.gid)
    assert untrusted_engine(binary, SERVICE) == f"{library} can be changed by llm-appliance"
    library.chmod(0o644)
    os.chown(library, 0, 0)
    assert untrusted_engine(binary, SERVICE) is None


def test_validate_as_root_runs_the_engines_help_as_the_service_user(
    example: Callable[..., Path], scratch: Path
) -> None:
    mark = _marks(scratch)
    binary = _engine(scratch / "ours", mark)
    spec = example("demo.toml", {"[server]\n": f'[server]\nbinary = "{binary}"\n'})
    validated = validate(spec)
    assert validated.facts.dialect_note is None  # its --help was read
    assert SERVICE is not None
    assert mark.read_text().split() == [str(SERVICE.uid)]


def test_root_does_not_parse_a_model_file_only_root_may_read(smollm2: Path, engine_binary: Path, scratch: Path) -> None:
    secret = scratch / "root-only.gguf"
    shutil.copyfile(smollm2, secret)
    secret.chmod(0o600)
    with pytest.raises(VocabUnavailable, match="could not load its vocabulary"):
        read_vocab(secret, engine_binary)
    secret.chmod(0o644)  # as a model the server may read: read as the service user, the same vocabulary
    assert read_vocab(secret, engine_binary).n_tokens == 49152
