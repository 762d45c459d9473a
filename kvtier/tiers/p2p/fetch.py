"""The loading half of the p2p tier: fetch chunks from a holder straight into host-region slots.

Each I/O thread keeps its own authenticated TCP connection per peer (thread-local, so no locking on
the data path). `fetch` sends one request naming up to MAX_FETCH_KEYS keys and reads the answers
back to back: per key the status block, the 4 KiB chunk header into a small buffer (checked:
magic, version, key, layout, length), then the row with `recv_into` directly into its slot
(aligned: see `protocol.BLOCK`), piece by piece, each piece fed to a streaming xxh3-128 while it is
still in cache (measured: half the CPU of hashing the whole row after it arrived), the last piece
read with the trailer and the next key's status. With a fleet key the digest is the keyed MAC
of the chunk (the holder's header says so; a row sealed otherwise is read and refused, counted as
a bad MAC): a peer that passes the p2p handshake without the fleet key cannot serve a forged row.
Only a row whose trailer is OK and whose digest matches the header is reported loaded; a holder
that closes, resets or stalls past `transfer_timeout_s` mid-batch fails the key in flight and the
rest of the batch (the slots' partial bytes are never published: the host tier rolls them back).

A connection reused after being idle may have been closed by the holder meanwhile: a failure before
any reply byte arrived on a reused connection is retried once on a fresh connection. A peer that
refuses connections, fails the handshake or breaks the protocol is skipped for
`reconnect_interval_s` (its loads fail at once meanwhile).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.format.chunks import ChunkError
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.p2p import protocol, rowhash
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.protocol import PeerFailure
from kvtier.tiers.p2p.tls import Tls


class _Reset(Exception):
    """The connection failed before the holder's first reply byte (it may just have been idle)."""


@dataclass
class Request:
    """One data request of one thread: its items, the connection it went out on (None: it could
    not be sent, its items fail), and what was loaded so far."""

    address: tuple[str, int]
    items: Sequence[tuple[bytes, memoryview]]
    done: list[bool]
    conn: socket.socket | None = None
    reused: bool = False
    unsent: bool = False


class Fetcher:
    def __init__(
        self, secret: Secret, layout_fp: bytes, row_bytes: int, book: TierBook, failures: FailureLog, *,
        connect_timeout_s: float, transfer_timeout_s: float, reconnect_interval_s: float,
        tls: Tls | None = None, fleet: FleetKey | None = None,
    ) -> None:
        self._secret = secret
        self._tls = tls
        self._fleet = fleet
        self._fp = layout_fp
        self._row_bytes = row_bytes
        self._spans = rowhash.piece_spans(row_bytes)
        self._book = book
        self._failures = failures
        self._connect_timeout_s = connect_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._reconnect_interval_s = reconnect_interval_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._down_until: dict[tuple[str, int], float] = {}
        self._all: set[socket.socket] = set()
        self._closed = False

    def fetch(self, address: tuple[str, int], items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """Load each (key, row) from the holder at `address` into its row; per item, True only when
        the row is verified. At most MAX_FETCH_KEYS items."""
        return self.complete(self.send(address, items))

    def send(self, address: tuple[str, int], items: Sequence[tuple[bytes, memoryview]]) -> Request:
        """Ask the holder at `address` for the items' keys (at most MAX_FETCH_KEYS); `complete` reads
        the answers. A thread may send several requests before completing them, in order: the
        holder answers back to back, so its connection never waits for our next request."""
        req = Request(address, items, [False] * len(items))
        with self._lock:
            if self._closed or time.monotonic() < self._down_until.get(address, 0.0):
                return req
        try:
            req.conn, req.reused = self._connection(address)
        except (OSError, protocol.AuthError, protocol.ProtocolError) as e:
            self._peer_down(address, f"connect:{type(e).__name__}", e)
            return req
        try:
            req.conn.sendall(protocol.encode_get([key for key, _ in items]))
        except OSError:
            req.unsent = True  # a connection closed while idle: `complete` tries a fresh one
        return req

    def complete(self, req: Request) -> list[bool]:
        """Read the answers to `req` into its rows; per item, True only when the row is verified.

        A request that got no reply byte on a reused connection is sent again once, on a fresh
        connection; any other failure marks the holder down and fails the keys not read yet."""
        for attempt in range(2):
            conn = req.conn
            if conn is None:
                return req.done
            try:
                if req.unsent:
                    raise _Reset("the request could not be sent")
                self._read_replies(conn, req.items, req.done)
                return req.done
            except _Reset as e:
                self._drop(req.address, conn)
                if req.reused and attempt == 0:
                    req = self.send(req.address, req.items)
                    continue
                self._peer_down(req.address, "transfer:closed", e)
            except (OSError, ConnectionError, protocol.ProtocolError) as e:
                self._drop(req.address, conn)
                self._peer_down(req.address, f"transfer:{type(e).__name__}", e)
            return req.done
        return req.done

    def _read_replies(self, conn: socket.socket, items: Sequence[tuple[bytes, memoryview]],
                      done: list[bool]) -> None:
        """Read the answers to one request, in order, into `done`."""
        block = protocol.BLOCK
        tail = memoryview(bytearray(2 * block))  # a row's trailer, and the next key's status
        try:
            protocol.recv_exact(conn, tail[block:])
        except (OSError, ConnectionError) as e:
            raise _Reset(str(e) or type(e).__name__) from None
        header = memoryview(bytearray(chunkfmt.HEADER_BYTES))
        for i, (key, row) in enumerate(items):
            more = i + 1 < len(items)
            status = bytes(tail[block:])
            if status == protocol.STATUS_MISS:
                self._book.count(TierCounter.LOAD_MISSES)
                if more:
                    protocol.recv_exact(conn, tail[block:])
                continue
            if status != protocol.STATUS_CHUNK:
                raise protocol.ProtocolError(f"unknown status block {status[:8]!r}...")
            done[i] = self._read_row(conn, key, header, row, tail[: block * (1 + more)])

    def _read_row(self, conn: socket.socket, key: bytes, header: memoryview, row: memoryview,
                  tail: memoryview) -> bool:
        """Read one chunk's header and row, then `tail`: its trailer (and the next key's status)."""
        (first, end), *rest = self._spans
        protocol.recv_parts(conn, [header, row[first:end]])
        err, digest = chunkfmt.check_header(header, key, self._fp, self._row_bytes, self._fleet)
        if err is not None and err is not ChunkError.MAC:
            raise protocol.ProtocolError(f"chunk header rejected: {err.value}")
        # A row sealed without the fleet key (or with it, to a reader without): read, then refused.
        whole = None if err is not None else chunkfmt.payload_digest(header, self._fleet)
        if whole is not None:
            whole.update(row[first:end])
        for n, (start, end) in enumerate(rest, 1):
            piece = row[start:end]
            protocol.recv_parts(conn, [piece, tail] if n == len(rest) else [piece])
            if whole is not None:
                whole.update(piece)
        if not rest:
            protocol.recv_exact(conn, tail)
        trailer = bytes(tail[: protocol.BLOCK])
        if trailer == protocol.TRAILER_ABORTED:
            self._book.count(TierCounter.LOAD_MISSES)
            return False
        if trailer != protocol.TRAILER_OK:
            raise protocol.ProtocolError(f"unknown trailer block {trailer[:8]!r}...")
        bad = err if whole is None else chunkfmt.check_digest(whole.digest(), digest, self._fleet)
        if bad is not None:
            self._book.bad(bad)
            self._failures.failed(f"bad:{bad.value}", PeerFailure(f"a received chunk failed its {bad.value}"))
            return False
        return True

    def _connection(self, address: tuple[str, int]) -> tuple[socket.socket, bool]:
        conns: dict[tuple[str, int], socket.socket] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(address)
        if conn is not None:
            return conn, True
        conn = socket.create_connection(address, timeout=self._connect_timeout_s)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            protocol.set_timeout(conn, self._transfer_timeout_s)
            if self._tls is not None:
                conn = self._tls.wrap_client(conn, self._transfer_timeout_s)
            protocol.client_handshake(conn, self._secret, self._fp, self._row_bytes)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if self._closed:
                conn.close()
                raise ConnectionError("the tier is shutting down")
            self._all.add(conn)
        conns[address] = conn
        return conn, False

    def _drop(self, address: tuple[str, int], conn: socket.socket) -> None:
        """Close `conn`, and forget it as this thread's connection to `address` if it still is."""
        conns: dict[tuple[str, int], socket.socket] = self._local.__dict__.get("conns", {})
        if conns.get(address) is conn:
            del conns[address]
        with self._lock:
            self._all.discard(conn)
        conn.close()

    def _peer_down(self, address: tuple[str, int], cause: str, exc: BaseException) -> None:
        with self._lock:
            self._down_until[address] = time.monotonic() + self._reconnect_interval_s
        self._book.count(TierCounter.PEER_ERRORS)
        self._failures.failed(cause, PeerFailure(f"holder {address[0]}:{address[1]}: {exc}"))

    def close(self) -> None:
        """Close every connection (threads blocked on one fail their key at once). Idempotent."""
        with self._lock:
            self._closed = True
            conns, self._all = self._all, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
