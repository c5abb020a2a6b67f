"""The one runner: every command is logged as `+ cmd`, and every failure is one CommandFailed that says
what ran, how it ended and what it said last."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance.system.run import PIPE, STDOUT, CommandFailed, run, spawn, started, stream


def test_a_command_is_logged_and_its_output_captured(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"):
        result = run(["sh", "-c", "echo out; echo err >&2", "a b"])
    assert caplog.messages == ["+ sh -c 'echo out; echo err >&2' 'a b'"]
    assert (result.returncode, result.stdout, result.stderr) == (0, "out\n", "err\n")


def test_a_quiet_probe_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"):
        assert run(["true"], quiet=True).returncode == 0
    assert caplog.messages == []


def test_a_failing_command_raises_with_argv_code_and_stderr_tail() -> None:
    with pytest.raises(CommandFailed) as failed:
        run(["sh", "-c", "echo x >&2; exit 3"])
    assert failed.value.argv == ["sh", "-c", "echo x >&2; exit 3"]
    assert failed.value.returncode == 3
    assert failed.value.output_tail == "x"
    assert str(failed.value) == "`sh -c 'echo x >&2; exit 3'` exited 3: x"


def test_only_the_tail_of_a_long_complaint_is_kept() -> None:
    with pytest.raises(CommandFailed) as failed:
        run(["sh", "-c", "echo first >&2; yes complaint | head -n 2000 >&2; echo last >&2; exit 1"])
    assert failed.value.output_tail.endswith("complaint\nlast")
    assert len(failed.value.output_tail) == 2000
    assert "first" not in failed.value.output_tail


def test_a_missing_program_raises_command_failed_not_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-program"
    for check in (True, False):
        with pytest.raises(CommandFailed) as failed:
            run([missing, "--help"], check=check)
        assert failed.value.returncode is None
        assert failed.value.argv == [str(missing), "--help"]
        assert str(failed.value).startswith(f"`{missing} --help` could not run: ")
        assert "No such file or directory" in str(failed.value)


def test_a_command_past_its_timeout_raises_and_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = f"echo $$ > {pid_file}; exec sleep 3600"
    with pytest.raises(CommandFailed, match=r"did not finish within 0.5 s") as failed:
        run(["sh", "-c", script], timeout=0.5)
    assert failed.value.returncode is None
    # Killed and reaped, not left running: its pid names no process any more (on a machine so busy that the
    # shell was killed before it wrote the file, there is nothing left to find either).
    if pid_file.exists():
        assert not Path(f"/proc/{pid_file.read_text().strip()}").exists()


def test_without_check_a_non_zero_exit_is_returned() -> None:
    result = run(["sh", "-c", "echo x >&2; exit 3"], check=False)
    assert (result.returncode, result.stderr) == (3, "x\n")


def test_the_locale_is_fixed_and_the_environment_passed_on() -> None:
    result = run(["sh", "-c", 'echo "$LC_ALL $EXTRA"'], env={"EXTRA": "yes", "LC_ALL": "de_DE.UTF-8"})
    assert result.stdout == "C.UTF-8 yes\n"


def test_stream_hands_over_each_line_and_raises_with_the_tail(caplog: pytest.LogCaptureFixture) -> None:
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"):
        stream(["sh", "-c", "echo one; echo two >&2"], lines.append)
    assert lines == ["one\n", "two\n"]
    assert caplog.messages == ["+ sh -c 'echo one; echo two >&2'"]
    with pytest.raises(CommandFailed) as failed:
        stream(["sh", "-c", "seq 1 100; exit 2"], lambda line: None)
    assert failed.value.returncode == 2
    assert failed.value.output_tail.splitlines() == [str(n) for n in range(60, 101)]


def test_stream_of_a_missing_program_raises_command_failed(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed) as failed:
        stream([tmp_path / "missing"], lambda line: None)
    assert failed.value.returncode is None


def test_spawn_starts_a_child_with_the_pipes_asked_for(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="llm-appliance.run"):
        child = spawn(["sh", "-c", "echo out; echo err >&2"], stdout=PIPE, stderr=STDOUT, bufsize=1)
    output, _ = child.communicate(timeout=10)
    assert (child.returncode, sorted(output.splitlines())) == (0, ["err", "out"])
    assert caplog.messages == ["+ sh -c 'echo out; echo err >&2'"]


def test_started_kills_a_child_still_running_at_the_end() -> None:
    with started(["sleep", "30"]) as child:
        assert child.poll() is None
    assert child.returncode == -9
