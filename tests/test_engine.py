"""Engine provisioning: the cached build is reused, a named binary is recorded, info shows the dialect."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance.cli.main import main
from appliance.facts.engine_manifest import Manifest
from appliance.ops import engine_build

pytestmark = pytest.mark.engine


def test_a_second_install_reuses_the_cached_build(
    engine_binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if Manifest.read(engine_binary.parent.parent) is None:
        pytest.fail("the engine under test was not installed by `llm-appliance engine install`")
    dest = tmp_path / "engine"
    first = engine_build.install(dest=dest)  # copies from the warm build cache: seconds, no compile
    second = engine_build.install(dest=dest)
    assert first == second
    assert Path(first.binary).is_file()
    assert first.version_line.startswith("version: 0.5.0-dev (build 1, commit 0c1e570)")
    assert first.source is not None and first.source["sha256"] == engine_build.PINNED.sha256
    assert "-DLLAMA_BUILD_SERVER=ON" in first.build_options
    assert "up to date" in capsys.readouterr().err
    # The libraries travel with the binary ($ORIGIN rpath): it runs from its new place.
    assert subprocess.run([first.binary, "--version"], capture_output=True, check=False).returncode == 0
    assert (dest / "bin" / "libllama.so").exists()


def test_a_named_binary_is_used_and_recorded(engine_binary: Path, tmp_path: Path) -> None:
    manifest = engine_build.install(dest=tmp_path / "engine", binary=str(engine_binary))
    assert manifest.origin == "user"
    assert manifest.binary == str(engine_binary)
    recorded = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert recorded["version_line"] == manifest.version_line


def test_a_named_binary_that_is_not_executable_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("not a program")
    with pytest.raises(engine_build.EngineError, match="not an executable"):
        engine_build.install(dest=tmp_path / "engine", binary=str(fake))


def test_build_options_key_the_cache() -> None:
    assert engine_build.options_key("cpu") != engine_build.options_key("cuda")
    assert "-DGGML_CUDA=ON" in engine_build.build_options("cuda")
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in engine_build.build_options("cpu")


def test_engine_info_prints_the_manifest_and_dialect(
    engine_binary: Path, outside_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = outside_tmp / "engine-info"  # its --help runs as the service user: not behind pytest's 0700 /tmp
    shutil.copytree(engine_binary.parent.parent, dest, symlinks=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["binary"] = str(dest / "bin" / "llama-server")
    (dest / "manifest.json").write_text(json.dumps(manifest))
    assert main(["engine", "info", "--dest", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "commit 0c1e570" in out
    assert "built-in dialect matches" in out
    assert "--spec-draft-n-max" in out and "--draft-max" not in out


def test_engine_info_without_a_manifest_exits_4(tmp_path: Path) -> None:
    assert main(["engine", "info", "--dest", str(tmp_path)]) == 4
