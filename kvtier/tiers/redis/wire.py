"""The Redis wire protocol (RESP) as the redis tier speaks it, bypassing redis-py past connecting.

redis-py opens each connection (TCP, unix socket or TLS, AUTH, SELECT); from then on the tier owns
its socket (`own_socket`): blocking, with the kernel's send and receive timeouts instead of Python's
poll loop, so a 2 MiB row moves in one system call. `set_command` frames a SET whose value is sent
from the host row as it is; `ReplyReader` reads every reply from the socket, bulk payloads straight
into caller buffers. `redact_url` hides the password of a Redis URL. Nothing here keeps state across
threads: each I/O thread owns its connection and its reader.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit

from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

_parse_error = cast(Callable[[str], Exception], BaseParser.parse_error)
"""redis-py's own error classes by the error's first word (untyped there): `MOVED` and `ASK` with
their slot and node, `LOADING` and `NOAUTH` as connection errors."""
_IOV_MAX = 1024
"""The most buffers one `sendmsg` takes (Linux's IOV_MAX)."""


def own_socket(sock: Any, timeout_s: float) -> None:
    """Make a connected socket blocking, each send or receive call failing (OSError) after
    `timeout_s` without progress: the kernel's timeouts (SO_SNDTIMEO, SO_RCVTIMEO), not Python's
    poll loop, so a gathered send or a MSG_WAITALL read is one system call. A TLS socket keeps
    Python's timeout (OpenSSL retries a read the kernel timed out)."""
    if isinstance(sock, ssl.SSLSocket):
        return
    sock.settimeout(None)
    whole = int(timeout_s)
    tv = struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class ReplyReader:
    """RESP replies read straight from a connection's socket, bulk payloads into caller buffers.

    redis-py's parsers hand a bulk reply over as a new `bytes` (after copying it through their own
    buffer); this reads a chunk's row from the socket into its host-region slot instead, with one
    MSG_WAITALL read for what its buffer does not hold yet. One reader per connection, for as long
    as it is open: the replies of a round sent after another may arrive in its buffer while the
    first round's are read. Error replies become redis-py's exception classes (`ResponseError`
    and its kinds, MOVED and ASK included), returned as the command's reply; those redis-py takes
    for a broken connection (`NOAUTH`, `LOADING`) are raised.
    """

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._waitall = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS takes no flags
        self._buf = bytearray(64 << 10)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    def _recv(self, out: memoryview, flags: int = 0) -> int:
        try:
            got: int = self._sock.recv_into(out, 0, flags)
        except BlockingIOError:  # the kernel's receive timeout
            raise RedisTimeoutError("timeout reading from the server") from None
        if got == 0:
            raise RedisConnectionError("connection closed by the server")
        return got

    def idle(self) -> bool:
        """Whether nothing was received beyond the replies read."""
        return self._start == self._end

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
            have += self._recv(out[have:], self._waitall)

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

    def reply(self) -> Any:
        """The next reply, as redis-py's `read_response(disable_decoding=True)` gives it: bytes for
        a status or bulk string, an int, None for a null, a list for an array (or a RESP3 set), a
        dict for a RESP3 map, a bool, an exception instance for an error. Other RESP3 types (the
        tier asks for none) end the connection."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            error = _parse_error(rest.decode(errors="replace"))
            if isinstance(error, RedisConnectionError):
                raise error
            return error
        if kind == b":":
            return int(rest)
        if (kind in (b"$", b"*") and rest == b"-1") or kind == b"_":
            return None
        if kind == b"$":
            out = bytearray(int(rest))
            self.read_into(memoryview(out))
            self.end_bulk()
            return bytes(out)
        if kind in (b"*", b"~", b">"):  # array; RESP3 set and push
            return [self.reply() for _ in range(int(rest))]
        if kind == b"%":  # RESP3 map (Valkey's CLUSTER SLOTS has one per node)
            items = [self.reply() for _ in range(2 * int(rest))]
            return dict(zip(items[::2], items[1::2], strict=True))
        if kind == b"#":
            return rest == b"t"
        raise RedisConnectionError(f"unexpected reply {line[:40]!r}")


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
        try:
            done = sock.sendmsg(views[:_IOV_MAX])
        except BlockingIOError:  # the kernel's send timeout, nothing sent
            raise RedisTimeoutError("timeout writing to the server") from None
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
