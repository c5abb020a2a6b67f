"""The one API client's streaming: how a stream ended is told apart (whole, refused, an error event, cut), against
a real HTTP server on loopback that answers as llama-server's endpoints do. The real llama-server's streams are
bench's and the fleet tests'."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from appliance.facts.listeners import listening_uids
from appliance.runtime.server_api import ServerApi, ServerUnreachable


def event(chunk: dict[str, object]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


DELTA = {"model": "m", "choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]}
LAST = {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}], "timings": {"predicted_n": 2}}
STREAMS: dict[str, tuple[int, list[bytes]]] = {
    "/whole": (200, [event(DELTA), event(LAST), b"data: [DONE]\n\n"]),
    # llama-server's own /completion: its last chunk says stop, and no [DONE] follows.
    "/completion": (200, [event({"content": "Hi", "stop": False}), event({"content": "!", "stop": True})]),
    "/error": (200, [event(DELTA), b'error: {"code": 500, "message": "slot failed"}\n\n']),
    "/cut": (200, [event(DELTA)]),
    "/refused": (503, [b'{"error": {"message": "Loading model", "type": "unavailable_error"}}']),
}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and self.headers["Authorization"] == "Bearer sk-test"
        status, parts = STREAMS[self.path.split("?")[0]]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
        self.send_header("X-Served-By", "local")
        self.send_header("Connection", "close")
        self.end_headers()
        for part in parts:
            self.wfile.write(part)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[ServerApi]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield ServerApi(f"http://127.0.0.1:{server.server_address[1]}", "sk-test")
    finally:
        server.shutdown()
        server.server_close()


def test_a_whole_stream_is_complete_with_its_text_timings_and_backend(api: ServerApi) -> None:
    answer = api.stream("/whole?n=3", {"messages": []}, served_by_header="X-Served-By")
    assert (answer.status, answer.chunks, answer.done, answer.complete) == (200, 2, True, True)
    assert answer.text == "Hello" and answer.final == LAST and answer.served_by == "local" and answer.model == "m"
    assert answer.first_content_seconds is not None and answer.error == ""


def test_llama_servers_own_completion_ends_with_its_stop_chunk(api: ServerApi) -> None:
    answer = api.stream("/completion", {"prompt": "x"})
    assert answer.complete and not answer.done and answer.text == "Hi!"


def test_an_error_event_a_cut_and_a_refusal_are_told_apart(api: ServerApi) -> None:
    errored = api.stream("/error", {})
    assert not errored.complete and "slot failed" in errored.error and errored.chunks == 1
    cut = api.stream("/cut", {})
    assert (cut.status, cut.complete) == (200, False)
    assert cut.error == "stream ended after 1 chunks without [DONE]"
    refused = api.stream("/refused", {})
    assert refused.status == 503 and "Loading model" in refused.error and refused.chunks == 0


def test_nothing_listening_is_no_response_not_an_exception() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as taken:
        port = taken.server_address[1]
    answer = ServerApi(f"http://127.0.0.1:{port}").stream("/whole", {})
    assert answer.status is None and answer.error.startswith("no response: ConnectionRefusedError")


# -- the key goes to the server's own listener only --


def test_the_key_is_not_sent_to_another_users_listener() -> None:
    """While the server restarts its port is free: `nobody` listens there. The launcher and the daemon (the
    server's user) send the key to nothing but a listener of their own uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to listen as another user")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    as_nobody = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
    squatter = subprocess.Popen([*as_nobody, sys.executable, "-c", SQUATTER, str(port)], stdout=subprocess.PIPE)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == b"listening\n"
        nobody = pwd.getpwnam("nobody").pw_uid
        assert listening_uids(port) == {nobody}
        guarded = ServerApi(f"http://127.0.0.1:{port}", "sk-the-key", timeout=2, listener_uid=os.geteuid())
        with pytest.raises(ServerUnreachable, match=f"held by uid {nobody}, not the server's"):
            guarded.health()
        assert "held by uid" in guarded.stream("/completion", {"prompt": "hi"}).error
        # The attack itself: the same request without the check hands the squatter the key. Without a key
        # there is nothing to keep from it.
        ServerApi(f"http://127.0.0.1:{port}", "sk-the-key", timeout=2).health()
        assert ServerApi(f"http://127.0.0.1:{port}", None, timeout=2, listener_uid=os.geteuid()).health() == 200
    finally:
        squatter.kill()
        out, _ = squatter.communicate()
    received = [bytes.fromhex(line.decode()) for line in out.split()]
    assert len(received) == 2, "the guarded requests reached the squatter"
    assert b"sk-the-key" in received[0] and b"sk-the-key" not in received[1]


def test_listeners_are_read_from_the_kernel() -> None:
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert listening_uids(port) == {os.geteuid()}
    assert listening_uids(port) == set()


# A listener anyone may run: it prints (in hex) what each client sends it, and answers 200.
SQUATTER = r"""
import socket, sys
port = int(sys.argv[1])
server = socket.socket()
server.bind(("127.0.0.1", port))
server.listen(8)
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(2)
    try:
        data = conn.recv(65536)
    except OSError:
        data = b""
    print(data.hex(), flush=True)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    conn.close()
"""
