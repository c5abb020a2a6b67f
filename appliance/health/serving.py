"""The exporter's HTTP server: wsgiref's handler behind a bound on connections, threads and time.

A scraper or a balancer sends its request at once. A client that opens connections and sends half a request,
or nothing, must not hold a thread each (300 such held 302 threads) nor, past the file limit, the one socket
/ready needs. So one thread reads every request's head, all at once (a selector), each within HEAD_SECONDS; only
a complete head goes to one of WORKERS threads, which answer within ANSWER_SECONDS; past MAX_READING unfinished
heads the oldest is closed, so a new request always finds room.
"""

from __future__ import annotations

import contextlib
import io
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

HEAD_SECONDS = 5.0  # a request line and headers arrive within this, or the connection is closed
ANSWER_SECONDS = 10.0  # each read or write of a worker's connection (a client that does not read the answer)
MAX_HEAD_BYTES = 16384
MAX_READING = 256  # unfinished heads held open at once: far below the daemon's file limit
MAX_WAITING = 64  # complete requests queued for a worker; more are closed unanswered
WORKERS = 4


class _Reading:
    """One connection whose head is still arriving."""

    def __init__(self, connection: socket.socket, address: Any, deadline: float) -> None:
        self.connection, self.address, self.deadline = connection, address, deadline
        self.head = b""


class BoundedServer(WSGIServer):
    """The accepting thread (serve_forever) hands each connection to the head reader; no thread per client."""

    request_queue_size = 128  # a burst of connections waits in the kernel, not refused at 5 (socketserver's)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Everything server_close needs exists before the bind: socketserver closes the server when its bind
        # fails (a port in use), and that must end in the caller's clear error, not an AttributeError.
        self._lock = threading.Lock()
        self._arrived: list[_Reading] = []
        self._heads: dict[socket.socket, bytes] = {}
        self._waiting = 0
        self._closed = False
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_write.setblocking(False)
        self._workers = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="exporter")
        self._reader = threading.Thread(target=self._read_heads, daemon=True, name="exporter-heads")
        super().__init__(*args, **kwargs)
        self._reader.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        request.setblocking(False)
        with self._lock:
            self._arrived.append(_Reading(request, client_address, time.monotonic() + HEAD_SECONDS))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
            self._wake_write.send(b"\0")

    def server_close(self) -> None:
        super().server_close()
        self._closed = True
        self._wake()
        if self._reader.is_alive():
            self._reader.join(timeout=5)  # it closes its end of the wake-up pair
        else:
            self._wake_read.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._wake_write.close()

    def head_of(self, connection: socket.socket) -> bytes:
        with self._lock:
            return self._heads.pop(connection, b"")

    def _read_heads(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ)
        reading: dict[socket.socket, _Reading] = {}  # in arrival order: the oldest first
        while not self._closed:
            soonest = min((r.deadline for r in reading.values()), default=time.monotonic() + 1.0)
            for key, _ in selector.select(max(0.0, soonest - time.monotonic())):
                if key.fileobj is self._wake_read:
                    self._wake_read.recv(4096)
                    continue
                entry = reading[key.fileobj]  # type: ignore[index]
                head = self._read_more(entry)
                if head != "more":
                    # Out of the selector before a worker (or the close) may free its descriptor for reuse.
                    selector.unregister(entry.connection)
                    del reading[entry.connection]
                    self._hand_on(entry, head == "whole")
            with self._lock:
                arrived, self._arrived = self._arrived, []
            for entry in arrived:
                while len(reading) >= MAX_READING:  # the oldest unfinished head makes room for the new
                    oldest = next(iter(reading.values()))
                    selector.unregister(oldest.connection)
                    del reading[oldest.connection]
                    self.shutdown_request(oldest.connection)
                selector.register(entry.connection, selectors.EVENT_READ)
                reading[entry.connection] = entry
            now = time.monotonic()
            for entry in [r for r in reading.values() if r.deadline <= now]:
                selector.unregister(entry.connection)
                del reading[entry.connection]
                self.shutdown_request(entry.connection)
        for entry in reading.values():
            self.shutdown_request(entry.connection)
        selector.close()
        self._wake_read.close()

    def _read_more(self, entry: _Reading) -> str:
        """Read what arrived: "more" to come, the "whole" head, or "broken" (closed, or too long)."""
        try:
            data = entry.connection.recv(4096)
        except BlockingIOError:
            return "more"
        except OSError:
            data = b""
        entry.head += data
        if not data or len(entry.head) > MAX_HEAD_BYTES:
            return "broken"
        return "whole" if b"\r\n\r\n" in entry.head or b"\n\n" in entry.head else "more"

    def _hand_on(self, entry: _Reading, whole: bool) -> None:
        """A whole head to a worker, unless MAX_WAITING wait already; anything else closed."""
        with self._lock:
            taken = whole and self._waiting < MAX_WAITING
            if taken:
                self._waiting += 1
                self._heads[entry.connection] = entry.head
        if not taken:
            self.shutdown_request(entry.connection)
            return
        entry.connection.setblocking(True)
        entry.connection.settimeout(ANSWER_SECONDS)
        self._workers.submit(self._answer, entry.connection, entry.address)

    def _answer(self, connection: socket.socket, address: Any) -> None:
        try:
            self.finish_request(connection, address)
        except Exception:  # one client's broken request is that client's, as in socketserver
            self.handle_error(connection, address)
        finally:
            with self._lock:
                self._waiting -= 1
                self._heads.pop(connection, None)
            self.shutdown_request(connection)


class BoundedServer6(BoundedServer):
    address_family = socket.AF_INET6


class QuietHandler(WSGIRequestHandler):
    """wsgiref's handler, reading the head the server already read; every scrape and check is no news."""

    server: BoundedServer

    def setup(self) -> None:
        super().setup()
        # The whole request is in the head: the exporter's routes are GETs, and the apps read no body.
        self.rfile = io.BytesIO(self.server.head_of(self.connection))

    def log_message(self, format: str, *args: Any) -> None:
        pass
