"""The Redis wire protocol (RESP) where the redis tier bypasses redis-py to avoid copies.

`set_command` frames a SET whose value is sent from the host row as it is; `ReplyReader` reads
replies from a connection's socket and bulk payloads straight into caller buffers. `redact_url`
hides the password of a Redis URL. Nothing here keeps state across threads: each I/O thread owns
its connection and its reader.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError

_IOV_MAX = 1024
"""The most buffers one `sendmsg` takes (Linux's IOV_MAX)."""


class ReplyReader:
    """RESP replies read straight from a connection's socket, bulk payloads into caller buffers.

    redis-py's parsers hand a bulk reply over as a new `bytes` (after copying it through their own
    buffer); this reads a chunk's row from the socket into its host-region slot instead. It is used
    between sending a pipeline and reading all of its replies, while redis-py's parser holds none
    of them (that parser reads only inside `read_response`, which is not called meanwhile).
    """

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray(64 << 10)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def _recv(self, out: memoryview) -> int:
        got: int = self._sock.recv_into(out)
        if got == 0:
            raise RedisConnectionError("connection closed by the server")
        return got

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while (i := self._buf.find(b"\r\n", self._start, self._end)) < 0:
            if self._start:
                n = self._end - self._start
                self._buf[:n] = self._view[self._start : self._end]
                self._start, self._end = 0, n
            if self._end == len(self._buf):
                raise RedisConnectionError("reply line too long")
            self._end += self._recv(self._view[self._end :])
        out = bytes(self._view[self._start : i])
        self._start = i + 2
        return out

    def read_into(self, out: memoryview) -> None:
        """Fill `out` with the next len(out) bytes of the stream."""
        have = min(len(out), self._end - self._start)
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < len(out):
            have += self._recv(out[have:])

    def drain(self, n: int, sink: Callable[[memoryview], object]) -> None:
        """Pass the next `n` bytes of the stream to `sink`, a bounded piece at a time."""
        while n:
            if self._start == self._end:
                self._start, self._end = 0, self._recv(self._view)
            take = min(n, self._end - self._start)
            sink(self._view[self._start : self._start + take])
            self._start += take
            n -= take

    def end_bulk(self) -> None:
        if self.line():
            raise RedisConnectionError("a bulk reply did not end where its length said")

    def finish(self) -> None:
        """Check that nothing beyond the expected replies arrived."""
        if self._start != self._end:
            raise RedisConnectionError("unexpected bytes after the pipeline's replies")


def send_buffers(sock: socket.socket, buffers: list[Any]) -> None:
    """Send `buffers` in order as gathered writes (one `sendmsg` while they fit, the rest from where
    it stopped), so a pipeline of SETs goes out without joining or copying its rows; through TLS,
    which has no gathered writes, one buffer at a time."""
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        done = sock.sendmsg(views[:_IOV_MAX])
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def redact_url(url: str) -> str:
    """`url` with the password (userinfo or `password=` query argument) replaced by `***`."""
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


def set_command(rkey: bytes, header: bytes, row: memoryview, px: bytes | None) -> list[Any]:
    """A RESP `SET rkey header+row [PX px]` as buffers; the row goes out as it is, uncopied."""
    n = len(header) + len(row)
    argc = 3 if px is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (argc, len(rkey), rkey, n)
    tail = b"\r\n" if px is None else b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(px), px)
    return [head + header, row, tail]
