"""The launcher against the real llama-server and the real demo models, with a NOTIFY_SOCKET of our own."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from conftest import resolved

from appliance.plan.resolved import Endpoint
from appliance.runtime.launch import _routine_warning
from appliance.runtime.notify import Notifier
from appliance.runtime.server_api import ServerApi, ServerUnreachable

pytestmark = pytest.mark.engine

# A model load has no interval in the spec to derive a budget from (the server unit allows 15 minutes); every
# wait on one ends at its event (a notification, a line, an exit), so this only bounds a load that hangs.
LOAD_SECONDS = 300.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class NotifySocket:
    """A datagram socket standing in for systemd's; records each message with /health's answer at arrival."""

    path: Path
    api: ServerApi | None = None
    messages: list[tuple[str, int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self.closed = threading.Event()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        while not self.closed.is_set():
            try:
                text = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            health = None
            if "READY=1" in text and self.api is not None:
                try:
                    health = self.api.health()
                except ServerUnreachable:
                    health = -1
            self.messages.append((text, health))

    def wait_for(self, fragment: str, timeout: float = LOAD_SECONDS) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for text, _ in self.messages:
                if fragment in text:
                    return text
            time.sleep(0.05)
        raise AssertionError(f"no notification with {fragment!r}; got {[m for m, _ in self.messages]}")

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@dataclass
class Running:
    process: subprocess.Popen[str]
    api: ServerApi
    notify: NotifySocket
    output: list[str]

    def child_pid(self, timeout: float = LOAD_SECONDS) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output:
                if m := re.search(r"started llama-server \(pid (\d+)\)", line):
                    return int(m.group(1))
            time.sleep(0.05)
        raise AssertionError("the launcher never said which pid it started")

    def text(self) -> str:
        return "".join(self.output)

    def wait_said(self, words: str, timeout: float = LOAD_SECONDS) -> None:
        """Until the launcher's output (read by a thread of its own, after the notify socket) holds `words`."""
        deadline = time.monotonic() + timeout
        while words not in self.text():
            assert self.process.poll() is None or words in self.text(), f"the launcher exited:\n{self.text()}"
            assert time.monotonic() < deadline, f"the launcher never said {words!r}:\n{self.text()}"
            time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped by its parent; check its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def launch(tmp_path: Path, example: Callable[[str], Path]) -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(
        edit: Callable[[list[str]], list[str]] = lambda argv: argv, stop_timeout: float = 10.0, spec: Path | None = None
    ) -> Running:
        port = free_port()
        appliance = resolved(spec or example("demo-draft.toml"))
        argv = [
            str(port) if previous == "--port" else arg
            for previous, arg in zip(["", *appliance.argv], appliance.argv, strict=False)
        ]
        plan = tmp_path / f"appliance-{port}.json"
        plan.write_text(replace(appliance, argv=tuple(edit(argv)), server=Endpoint("127.0.0.1", port)).to_json("test"))
        api = ServerApi(f"http://127.0.0.1:{port}", timeout=5.0)
        notify = NotifySocket(tmp_path / f"notify-{port}.sock", api)
        env = {**os.environ, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000", "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "appliance.cli.main",
                "launch",
                "--snapshot",
                str(plan),
                "--stop-timeout",
                str(stop_timeout),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        output: list[str] = []
        threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
        running = Running(process, api, notify, output)
        started.append(running)
        return running

    yield start
    for running in started:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()
        running.notify.close()


def test_ready_only_once_loaded_then_drafts_and_pings_the_watchdog(launch: Callable[..., Running]) -> None:
    running = launch()
    loading = running.notify.wait_for("STATUS=loading model")
    ready = running.notify.wait_for("READY=1")
    texts = [text for text, _ in running.notify.messages]
    assert texts.index(loading) < texts.index(ready)
    health_at_ready = next(health for text, health in running.notify.messages if "READY=1" in text)
    assert health_at_ready == 200, "READY=1 was sent before /health answered 200"
    assert "STATUS=ready at http://127.0.0.1:" in ready

    before = running.api.metrics()
    answer = running.api.chat(
        [{"role": "user", "content": "Write a Python function that adds two numbers."}], max_tokens=48, temperature=0
    )
    assert answer["choices"][0]["message"]["content"]
    assert answer["timings"]["draft_n"] > 0
    assert answer["timings"]["draft_n_accepted"] > 0
    after = running.api.metrics()
    assert after["spec_decode_num_draft_tokens_total"] > before.get("spec_decode_num_draft_tokens_total", 0)
    assert after["spec_decode_num_accepted_tokens_total"] > before.get("spec_decode_num_accepted_tokens_total", 0)

    running.notify.wait_for("speculation engaged", timeout=20)
    running.notify.wait_for("WATCHDOG=1", timeout=10)
    # The log line and the status go out together; the output reaches the test through a pipe and a thread.
    running.wait_said("speculation engaged")


def test_missing_spec_type_is_reported_as_not_engaged(launch: Callable[..., Running]) -> None:
    def without_spec_type(argv: list[str]) -> list[str]:
        index = argv.index("--spec-type")
        return argv[:index] + argv[index + 2 :]

    running = launch(without_spec_type)
    running.notify.wait_for("READY=1")
    running.api.completion("def add(a, b):", n_predict=16, temperature=0)
    status = running.notify.wait_for("SPECULATION NOT ENGAGED", timeout=20)
    assert status.startswith("STATUS=")
    running.wait_said("SPECULATION NOT ENGAGED")


@pytest.fixture
def ngram_only(example: Callable[..., Path]) -> Path:
    """The demo (ngram-mod alone, no draft model), with short n-grams so a short answer drafts."""
    return example(
        "demo.toml",
        {"[network]": "[speculative.ngram_mod]\nn_match = 8\nn_min = 2\nn_max = 16\n\n[network]"},
    )


def strip_spec_type(argv: list[str]) -> list[str]:
    index = argv.index("--spec-type")
    return argv[:index] + argv[index + 2 :]


def test_ngram_speculation_without_a_draft_is_checked_and_engages(
    launch: Callable[..., Running], ngram_only: Path
) -> None:
    running = launch(spec=ngram_only)
    ready = running.notify.wait_for("READY=1")
    assert "(speculation without a draft model)" in ready
    # Text that repeats, which n-gram speculation drafts from.
    prompt = "".join(f"def add_{i}(a: int, b: int) -> int:\n    return a + b\n\n" for i in range(12))
    answer = running.api.completion(prompt, n_predict=96, temperature=0)
    assert answer["timings"]["draft_n"] > 0
    running.notify.wait_for("speculation engaged", timeout=20)
    running.wait_said("speculation engaged: ")
    assert "NOT ENGAGED" not in running.text()


def test_ngram_speculation_refused_is_not_engaged_and_says_no_draft(
    launch: Callable[..., Running], ngram_only: Path
) -> None:
    running = launch(strip_spec_type, spec=ngram_only)
    status = running.notify.wait_for("SPECULATION NOT ENGAGED", timeout=LOAD_SECONDS)
    assert status.startswith("STATUS=")
    text = running.text()
    assert "SPECULATION NOT ENGAGED: speculative.type is configured but llama-server did not initialise" in text
    assert "draft model is configured" not in text


def test_sigterm_during_a_long_generation_stops_the_child_within_the_bound(launch: Callable[..., Running]) -> None:
    running = launch(stop_timeout=5.0)
    running.notify.wait_for("READY=1")
    child = running.child_pid()
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            running.api.completion("Once upon a time", n_predict=4000, temperature=0.8, ignore_eos=True, timeout=120)
        except ServerUnreachable as exc:
            errors.append(exc)

    threading.Thread(target=generate, daemon=True).start()
    deadline = time.monotonic() + 30
    while not any(slot.get("is_processing") for slot in running.api.slots()):
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.1)
    sent = time.monotonic()
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=20) == 0
    assert time.monotonic() - sent < 5.0 + 5.0
    assert not pid_alive(child), "llama-server outlived the launcher"
    running.notify.wait_for("STOPPING=1", timeout=10)  # sent before the exit: only our listener can be late


def test_a_corrupt_model_fails_with_one_clear_line_and_no_orphan(
    launch: Callable[..., Running], tmp_path: Path, smollm2: Path
) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2.read_bytes()[: smollm2.stat().st_size // 2])

    def corrupt(argv: list[str]) -> list[str]:
        return [str(truncated) if arg == str(smollm2) or arg.endswith(smollm2.name) else arg for arg in argv]

    running = launch(corrupt)
    child = running.child_pid()
    assert running.process.wait(timeout=LOAD_SECONDS) == 1
    lines = [line for line in running.output if "failed to load the model" in line]
    assert len(lines) == 1, running.text()[-3000:]
    assert "exit" in lines[0]
    # llama-server's own error still reaches the journal at --log-verbosity 2, and the launcher's line names it.
    assert any(line.startswith("E llama_model_load: error loading model") for line in running.output), running.text()
    assert "error loading model" in lines[0]
    assert not pid_alive(child)
    assert not any("READY=1" in text for text, _ in running.notify.messages)


# Requests whose journal lines are counted: enough that a per-request line would show N times over.
REQUESTS = 5
# What llama-server at its default (info) writes per request on the demo: slot selection (2), the timings (5:
# prompt, eval, total, graphs reused, draft acceptance) and the release; measured 8.
INFO_LINES_PER_REQUEST = 8


def _with_log_level(level: str) -> Callable[[list[str]], list[str]]:
    def edit(argv: list[str]) -> list[str]:
        index = argv.index("--log-verbosity")
        return [*argv[: index + 1], level, *argv[index + 2 :]]

    return edit


def _requests_lines(running: Running) -> list[str]:
    """The lines the launcher relays while REQUESTS short chats run, once the first (and the launcher's
    "speculation engaged" after it) has been logged. The same prompt each time, as the health daemon's canary
    sends it: llama-server warns each time that it answers one wholly from its cache."""
    chat = [{"role": "user", "content": "Say hello."}]
    running.api.chat(chat, max_tokens=8, temperature=0)
    running.notify.wait_for("speculation engaged", timeout=20)
    before = len(running.output)
    for _ in range(REQUESTS):
        running.api.chat(chat, max_tokens=8, temperature=0)
    # llama-server logs from a thread of its own and the launcher relays from another: let both catch up.
    time.sleep(2.0)
    return running.output[before:]


def test_requests_add_no_journal_lines_while_start_ready_speculation_and_stop_are_logged(
    launch: Callable[..., Running],
) -> None:
    running = launch()
    running.notify.wait_for("READY=1")
    added = _requests_lines(running)
    # llama-server at --log-verbosity 2 writes its warnings and errors only; the routine one of a cached prompt
    # (two lines per request) is relayed once, with the launcher's note, and then no more.
    assert len(added) == 2, "".join(added)
    assert added[0].startswith("W ") and "need to evaluate at least 1 token" in added[0], added[0]
    assert "not relayed again until it restarts" in added[1], added[1]
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=30) == 0
    time.sleep(0.2)  # the reader thread's last lines
    text = running.text()
    for line in ("started llama-server (pid", "llama-server is ready after", "speculation engaged: ", "stopped"):
        assert sum(line in out for out in running.output) == 1, f"{line!r} not logged once:\n{text}"
    assert "print_timing" not in text


def test_only_llama_servers_routine_warnings_are_held_back() -> None:
    cached = "W slot   operator(): id  0 | task 33 | n_past was set to 32\n"
    assert _routine_warning(cached) == "prompt answered wholly from its cache"
    for line in (
        "E slot   operator(): id  0 | task 33 | n_past was set to 32\n",  # an error is never routine
        "W slot update_slots: id  0 | task 9 | slot context shift, n_keep = 0, n_left = 4094, n_discard = 2047\n",
        "W srv  try_clear_id: purging slot 0 with 4000 tokens\n",
        "n_past was set to 32\n",
    ):
        assert _routine_warning(line) is None, line


def test_at_info_each_request_writes_its_timings(launch: Callable[..., Running]) -> None:
    """What the default log level spares the journal (and that the count above would see it)."""
    running = launch(_with_log_level("3"))
    running.notify.wait_for("READY=1")
    added = _requests_lines(running)
    assert len(added) >= REQUESTS * INFO_LINES_PER_REQUEST, "".join(added)
    assert sum("print_timing" in line for line in added) == REQUESTS * 5, "".join(added)


def test_a_killed_launcher_takes_llama_server_with_it(launch: Callable[..., Running]) -> None:
    running = launch()
    running.notify.wait_for("READY=1")
    child = running.child_pid()
    running.process.kill()
    running.process.wait()
    deadline = time.monotonic() + 10
    while pid_alive(child):
        assert time.monotonic() < deadline, "llama-server survived a SIGKILLed launcher"
        time.sleep(0.1)


def test_a_broken_notify_socket_is_logged_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    notifier = Notifier()
    assert notifier.ready("ready") is False
    assert notifier.watchdog() is False
    errors = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(errors) == 1


def test_without_notify_socket_nothing_is_sent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    caplog.set_level("INFO")
    assert Notifier().ready("ready") is False
    assert any("NOTIFY_SOCKET is not set" in r.getMessage() for r in caplog.records)
