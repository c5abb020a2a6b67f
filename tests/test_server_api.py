"""The one API client's streaming: how a stream ended is told apart (whole, refused, an error event, cut), against
a real HTTP server on loopback that answers as llama-server's endpoints do. The real llama-server's streams are
bench's and the fleet tests'."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from appliance.runtime.server_api import ServerApi


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
