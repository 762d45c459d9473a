"""The serving half of a p2p tier: answers peers' lookups and sends them chunks from the host region.

Control: one thread owns a ZMQ ROUTER bound to `listen` (a CURVE server when configured: `curve`).
It answers each valid LOOKUP with which keys the `ChunkIndex` claims; a message with a wrong tag or
a broken format is counted, logged once per cause, and dropped unanswered (the asker times out: a
miss). ZMQ's MAXMSGSIZE cuts off a peer that sends an oversized message before it is buffered.

Data: one thread accepts TCP connections on the same host (an ephemeral port, reported in answers);
each accepted connection gets its own thread (at most `max_connections` at once; more are closed at
once). A connection authenticates (`protocol.server_handshake`) within `handshake_timeout_s`, then
serves requests until the peer closes it, stays idle for `idle_timeout_s`, or breaks the protocol.
A request names up to MAX_FETCH_KEYS keys, answered back to back. Each row is sent straight from
the region, piece by piece (`rowhash`), as a seqlock read of the slot (`host.generations`): a slot
whose generation is no longer the one its claim recorded at STORE time is a miss; a slot whose
generation changed while its row was being sent (the host tier reused it) gets an ABORTED trailer,
which voids the row: the requester fails that key and never uses its bytes. Reading two words
replaces re-hashing every piece before its send (measured: 12-16 ms of the holder's CPU per 256 MiB
of rows). The answer's blocks are multiples of `protocol.BLOCK`, so rows reach the requester
aligned. The requester checks every row against the checksum in its header (computed at STORE
time), so a row changed in place without a new generation is still rejected there: a peer never
loads another chunk's bytes.

`close()` stops both threads and every connection; it is idempotent.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from urllib.parse import urlsplit

import zmq

from kvtier.ops.metrics import TierCounter
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.p2p import protocol, rowhash
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.curve import Curve
from kvtier.tiers.p2p.index import ChunkIndex
from kvtier.tiers.p2p.protocol import PeerFailure
from kvtier.tiers.p2p.tls import Tls

POLL_MS = 200


class P2PServer:
    """Serves `index`'s chunks out of `region` to authenticated peers."""

    def __init__(
        self, zctx: zmq.Context[zmq.Socket[bytes]], listen: str, secret: Secret, index: ChunkIndex,
        region: memoryview, generations: memoryview, row_bytes: int, layout_fp: bytes,
        instance_id: bytes, book: TierBook, failures: FailureLog, *, max_connections: int,
        handshake_timeout_s: float, idle_timeout_s: float, transfer_timeout_s: float,
        curve: Curve | None = None, tls: Tls | None = None,
    ) -> None:
        self._secret = secret
        self._tls = tls
        self._index = index
        self._region = region
        self._generations = generations
        self._row_bytes = row_bytes
        self._fp = layout_fp
        self._instance_id = instance_id
        self._book = book
        self._failures = failures
        self._max_connections = max_connections
        self._handshake_timeout_s = handshake_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._spans = rowhash.piece_spans(row_bytes)
        self._zeros = memoryview(bytes(max(end - start for start, end in self._spans)))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._router = zctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_CONTROL_BYTES)
        if curve is not None:
            curve.make_server(self._router)
        try:
            self._router.bind(listen)
            self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            host = urlsplit(self.address).hostname or "127.0.0.1"
            self._listener = socket.create_server((host, 0), family=_family(host), backlog=64)
        except BaseException:
            self._router.close()
            raise
        self._listener.settimeout(POLL_MS / 1000)
        self.data_port: int = self._listener.getsockname()[1]
        self._threads = [
            threading.Thread(target=self._control_loop, name="kvtier-p2p-control", daemon=True),
            threading.Thread(target=self._accept_loop, name="kvtier-p2p-accept", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- control ---------------------------------------------------------------------------

    def _control_loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._router.poll(POLL_MS):
                    continue
                frames = self._router.recv_multipart()
                reply = self._answer(frames[1:])
                if reply is not None:
                    self._router.send_multipart([frames[0], *reply])
        finally:
            self._router.close()

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        try:
            msg = protocol.decode_control(self._secret, frames)
        except protocol.AuthError as e:
            self._book.count(TierCounter.AUTH_REFUSED)
            self._failures.failed("auth:control", PeerFailure(f"refused a control message: {e}"))
            return None
        except protocol.ProtocolError as e:
            self._book.count(TierCounter.MALFORMED)
            self._failures.failed("malformed:control", PeerFailure(f"dropped a control message: {e}"))
            return None
        if msg.op != protocol.OP_LOOKUP:
            self._failures.failed("malformed:control", PeerFailure("dropped a control message: not a lookup"))
            return None
        self._book.count(TierCounter.LOOKUPS_SERVED, msg.count)
        if (msg.layout_fp, msg.row_bytes) == (self._fp, self._row_bytes):
            held = bytes(self._index.holds(msg.keys()))
        else:
            held = bytes(msg.count)
        return protocol.encode_control(
            self._secret, protocol.OP_ANSWER, msg.request_id, self._instance_id, self._fp,
            self._row_bytes, held, msg.count, self.data_port,
        )

    # ---- data ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self._max_connections or self._stop.is_set()
                if not full:
                    self._conns.add(conn)
            if full:
                self._failures.failed("connections:full", PeerFailure("refused a data connection (limit)"))
                conn.close()
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), name="kvtier-p2p-serve",
                             daemon=True).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            protocol.set_timeout(conn, self._handshake_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._wrap(conn, self._tls)
            if not protocol.server_handshake(conn, self._secret, self._fp, self._row_bytes):
                return
            head = memoryview(bytearray(protocol.STATUS_CHUNK + bytes(chunkfmt.HEADER_BYTES)))
            while not self._stop.is_set():
                protocol.set_timeout(conn, self._idle_timeout_s)
                keys = protocol.read_get(conn)
                self._book.count(TierCounter.DATA_REQUESTS)
                protocol.set_timeout(conn, self._transfer_timeout_s)
                for key in keys:
                    self._send_chunk(conn, key, head)
        except protocol.AuthError as e:
            self._book.count(TierCounter.AUTH_REFUSED)
            self._failures.failed("auth:data", PeerFailure(f"refused a data connection: {e}"))
        except protocol.ProtocolError as e:
            self._book.count(TierCounter.MALFORMED)
            self._failures.failed("malformed:data", PeerFailure(f"closed a data connection: {e}"))
        except (OSError, ConnectionError):
            pass  # the requester went away or idled out; it reconnects when it needs us
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _wrap(self, conn: socket.socket, tls: Tls) -> socket.socket:
        """`conn` after the TLS handshake, in place of the plain socket among the connections
        `close` ends (the plain one is detached by the wrap). A handshake that fails (no TLS, a
        certificate the fleet CA did not sign) or does not end within the handshake timeout raises
        AuthError."""
        with self._lock:
            self._conns.discard(conn)
        try:
            wrapped = tls.wrap_server(conn, self._handshake_timeout_s)
        except ssl.SSLError as e:
            raise protocol.AuthError(f"TLS handshake failed ({e.reason})") from None
        except OSError:
            raise protocol.AuthError("no TLS handshake within handshake_timeout_s") from None
        with self._lock:
            self._conns.add(wrapped)
        return wrapped

    def _send_chunk(self, conn: socket.socket, key: bytes, head: memoryview) -> None:
        """Answer one key: a miss, or the header and the row, then the trailer.

        A slot whose generation is not the claim's is a plain miss. One whose generation changed
        by the time the row's last byte was sent gets TRAILER_ABORTED (the key is forgotten): the
        requester then fails the key and discards the bytes. The generation is read again before
        each piece: once it changed, the rest of the row goes as zeros, so at most the piece in
        flight can carry the bytes of the chunk that reused the slot. The status and header go out with the
        first piece; the trailer goes alone, after the second read of the generation.
        """
        claim = self._index.claim(key)
        if claim is None:
            self._send_miss(conn)
            return
        if self._generations[claim.slot] != claim.generation:
            self._stale(key, claim.slot)
            self._send_miss(conn)
            return
        row = self._region[claim.slot * self._row_bytes : (claim.slot + 1) * self._row_bytes]
        chunkfmt.pack_header_digest(head[protocol.BLOCK :], key, self._fp, self._row_bytes, claim.digest)
        for i, (start, end) in enumerate(self._spans):
            if i and self._generations[claim.slot] != claim.generation:
                for rest_start, rest_end in self._spans[i:]:  # never the new chunk's next pieces
                    conn.sendall(self._zeros[: rest_end - rest_start])
                break
            protocol.send_parts(conn, [head, row[start:end]] if i == 0 else [row[start:end]])
        if self._generations[claim.slot] != claim.generation:
            self._stale(key, claim.slot)
            self._book.count(TierCounter.SERVE_ABORTED)
            conn.sendall(protocol.TRAILER_ABORTED)
            return
        self._book.count(TierCounter.CHUNKS_SERVED)  # before the trailer: once it arrives, it shows
        conn.sendall(protocol.TRAILER_OK)

    def _stale(self, key: bytes, slot: int) -> None:
        """`slot` no longer holds `key`'s row: forget the claim (counted once)."""
        if self._index.forget(key, slot):
            self._book.count(TierCounter.STALE_DROPPED)

    def _send_miss(self, conn: socket.socket) -> None:
        self._book.count(TierCounter.SERVE_MISSES)
        conn.sendall(protocol.STATUS_MISS)

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop serving: both threads end, every connection is closed. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
