"""A loopback TCP proxy that makes a fast server slow: a fixed latency per request and a bandwidth cap.

`ThrottleProxy(host, port, latency_s, bytes_per_s)` listens on 127.0.0.1 (a free port, `port`
once `start`ed) and relays each connection to `host:port`, two threads per connection:
- client → server: the first bytes the client sends after the server last sent on that connection
  (an HTTP request on a kept-alive connection, or its body after a `100 Continue`) are held
  `latency_s` before they are relayed; the rest of a request goes on at once;
- server → client: relayed in pieces of at most 64 KiB, each followed by a pause of its size over
  `bytes_per_s` (0: no cap), so one connection never receives faster than the cap.
A benchmark points a tier's endpoint at the proxy (`bench_choice_remote`: the obj tier on SeaweedFS).
`close` stops accepting and closes every connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

PIECE = 64 * 1024


class ThrottleProxy:
    """See the module docstring."""

    def __init__(self, host: str, port: int, latency_s: float, bytes_per_s: float = 0.0) -> None:
        self.target = (host, port)
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> ThrottleProxy:
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        with self._lock:
            sockets, self._sockets = [self._listener, *self._sockets], []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            answered = threading.Event()
            answered.set()  # a fresh connection's first bytes are a request
            threading.Thread(target=self._requests, args=(client, server, answered), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, answered), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, answered: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(PIECE):
                if answered.is_set():
                    answered.clear()
                    time.sleep(self.latency_s)
                dst.sendall(data)
        _close_both(src, dst)

    def _answers(self, src: socket.socket, dst: socket.socket, answered: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(PIECE):
                answered.set()
                dst.sendall(data)
                if self.bytes_per_s:
                    time.sleep(len(data) / self.bytes_per_s)
        _close_both(src, dst)


def _close_both(a: socket.socket, b: socket.socket) -> None:
    for s in (a, b):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
