"""The daemon's view of the server unit through systemctl (a stand-in on PATH answers as systemd would):
questions are quiet, the restart is logged, and a failure is a UnitError saying what ran and what it said."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance.health.units import SystemdUnit, UnitError

SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls"
case "$1" in
  show) echo 4242 ;;
  is-active) echo "$STATE"; [ "$STATE" = active ] ;;
  restart) echo "Failed to restart $3: Access denied" >&2; exit 4 ;;
esac
"""


@pytest.fixture
def systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fake = tmp_path / "bin" / "systemctl"
    fake.parent.mkdir()
    fake.write_text(SYSTEMCTL)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    return fake.parent / "calls"


def test_questions_are_answered_and_not_logged(
    systemctl: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unit = SystemdUnit("llm-appliance-server.service")
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"):
        assert unit.main_pid() == 4242
        monkeypatch.setenv("STATE", "active")
        assert unit.active()
        monkeypatch.setenv("STATE", "inactive")  # systemctl exits 3: an answer, not a failure
        assert not unit.active()
    assert caplog.messages == []
    assert systemctl.read_text().splitlines() == [
        "show --property=MainPID --value llm-appliance-server.service",
        "is-active llm-appliance-server.service",
        "is-active llm-appliance-server.service",
    ]


def test_a_failed_restart_is_logged_and_raises_with_what_systemctl_said(
    systemctl: Path, caplog: pytest.LogCaptureFixture
) -> None:
    unit = SystemdUnit("llm-appliance-server.service")
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"), pytest.raises(UnitError) as failed:
        unit.restart("decay")
    assert caplog.messages == ["+ systemctl restart --no-block llm-appliance-server.service"]
    assert str(failed.value) == (
        "`systemctl restart --no-block llm-appliance-server.service` exited 4: "
        "Failed to restart llm-appliance-server.service: Access denied"
    )


def test_systemctl_that_cannot_run_is_a_unit_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no systemctl anywhere
    with pytest.raises(UnitError, match=r"`systemctl is-active x.service` could not run"):
        SystemdUnit("x.service").active()
