"""The serving half of a p2p tier: answers peers' lookups and sends them chunks from the host region.

Control: one thread owns a ZMQ ROUTER bound to `listen` (a CURVE server when configured: `curve`).
It answers each valid LOOKUP with which keys the `ChunkIndex` claims; a message with a wrong tag or
a broken format is counted, logged once per cause, and dropped unanswered (the asker times out: a
miss). ZMQ's MAXMSGSIZE cuts off a peer that sends an oversized message before it is buffered.

Data: one thread accepts TCP connections on the same host (an ephemeral port, reported in answers),
each served by its own thread. A connection authenticates (TLS when configured, then
`protocol.server_handshake`) by a deadline `handshake_timeout_s` after its accept, however slowly its
peer keeps sending (the accept thread shuts it down then). Handshaking connections are held apart:
at most `max_handshakes_per_address` from one address (more are closed at once) and `max_handshakes`
in all (a new one ends the oldest of the address holding the most), so idle unauthenticated clients
take neither the slots of peers nor a peer's own handshake; at most `max_connections` authenticated
ones serve requests until the peer closes, idles for `idle_timeout_s`, or breaks the protocol.
The accept thread runs until `close()`: a failed accept (EMFILE, ENFILE or any error) is logged once
per cause and retried after a back-off (10 ms doubling to 200 ms), one its peer aborted at once.
`healthy()` is False while the thread is gone or accepting has failed for DOWN_AFTER_S: the tier
reports its server down, and lookups are answered as holding nothing.

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
import errno
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq

from kvtier.ops.metrics import TierCounter
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.p2p import protocol, rowhash
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.curve import Curve
from kvtier.tiers.p2p.index import ChunkIndex
from kvtier.tiers.p2p.protocol import PeerFailure
from kvtier.tiers.p2p.tls import Tls

POLL_MS = 200
DOWN_AFTER_S = 1.0
"""How long accepting may fail without a success before the data server is taken as down."""
BACKOFF_S = (0.01, POLL_MS / 1000)  # the first and longest wait after a failed accept
PEER_ABORTED = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR)  # retried at once


@dataclass(eq=False)
class _Handshake:
    """A connection not authenticated yet: its socket (the TLS one once wrapped), its peer's
    address, when it was accepted and its deadline; `ended` says why the accept thread shut it
    down ("" while it may go on). Changed under the server's lock."""

    sock: socket.socket
    host: str
    accepted: float
    deadline: float
    ended: str = ""


class P2PServer:
    """Serves `index`'s chunks out of `region` to authenticated peers."""

    def __init__(
        self, zctx: zmq.Context[zmq.Socket[bytes]], listen: str, secret: Secret, index: ChunkIndex,
        region: memoryview, generations: memoryview, row_bytes: int, layout_fp: bytes,
        instance_id: bytes, book: TierBook, failures: FailureLog, *, max_connections: int,
        handshake_timeout_s: float, idle_timeout_s: float, transfer_timeout_s: float,
        curve: Curve | None = None, tls: Tls | None = None, max_handshakes: int = 16,
        max_handshakes_per_address: int = 4, fleet: FleetKey | None = None,
    ) -> None:
        self._secret, self._fleet, self._tls = secret, fleet, tls
        self._index = index
        self._region = region
        self._generations = generations
        self._row_bytes = row_bytes
        self._fp = layout_fp
        self._instance_id = instance_id
        self._book = book
        self._failures = failures
        self._max_connections = max_connections
        self._max_handshakes = max_handshakes
        self._max_per_address = max_handshakes_per_address
        self._handshake_timeout_s = handshake_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._spans = rowhash.piece_spans(row_bytes)
        self._zeros = memoryview(bytes(max(end - start for start, end in self._spans)))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._handshakes: set[_Handshake] = set()
        self._authenticated = 0
        self._failing_since: float | None = None
        """When the current run of failed accepts began (None: the last accept worked)."""
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
        if (msg.layout_fp, msg.row_bytes) == (self._fp, self._row_bytes) and self.healthy():
            held = bytes(self._index.holds(msg.keys()))
        else:
            held = bytes(msg.count)
        return protocol.encode_control(
            self._secret, protocol.OP_ANSWER, msg.request_id, self._instance_id, self._fp,
            self._row_bytes, held, msg.count, self.data_port,
        )

    # ---- data ------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether peers can reach the data server: the accept thread runs and accepting has not
        failed for DOWN_AFTER_S."""
        since = self._failing_since
        return self._threads[1].is_alive() and (since is None or time.monotonic() - since < DOWN_AFTER_S)

    def _accept_loop(self) -> None:
        """Accept, end handshakes past their deadline, back off after failures; until `close`."""
        backoff = 0.0
        while not self._stop.is_set():
            self._end_late_handshakes()
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                self._failing_since = None
                continue
            except Exception as e:  # never end the thread: a failed accept is retried
                if self._stop.is_set():
                    return
                code = getattr(e, "errno", None)
                if code in PEER_ABORTED:
                    continue
                self._failing_since = self._failing_since or time.monotonic()
                cause = errno.errorcode.get(code, type(e).__name__) if code else type(e).__name__
                self._failures.failed(f"accept:{cause}", PeerFailure(f"accept failed: {e}"))
                backoff = min(max(2 * backoff, BACKOFF_S[0]), BACKOFF_S[1])
                self._stop.wait(backoff)
                continue
            backoff, self._failing_since = 0.0, None
            self._admit(conn, str(peer[0]))

    def _admit(self, conn: socket.socket, host: str) -> None:
        """Start the handshake of a new connection from `host`, within the handshake caps (the
        oldest handshake makes room when all are taken); close it at once when its address is at
        its cap or the server is closing."""
        now = time.monotonic()
        oldest: _Handshake | None = None
        with self._lock:
            going = [h for h in self._handshakes if not h.ended]
            refused = ("closing" if self._stop.is_set()
                       else "address" if sum(h.host == host for h in going) >= self._max_per_address
                       else "")
            if not refused:
                if len(going) >= self._max_handshakes:
                    held = Counter(h.host for h in going)
                    oldest = min(going, key=lambda h: (-held[h.host], h.accepted))
                    oldest.ended = "ended for a newer connection (max_handshakes)"
                handshake = _Handshake(conn, host, now, now + self._handshake_timeout_s)
                self._handshakes.add(handshake)
                self._conns.add(conn)
        if refused:
            if refused == "address":
                self._failures.failed("handshakes:address", PeerFailure(
                    f"refused a data connection from {host} (max_handshakes_per_address)"))
            conn.close()
            return
        if oldest is not None:
            _end(oldest.sock)
        threading.Thread(target=self._serve_conn, args=(handshake,), name="kvtier-p2p-serve",
                         daemon=True).start()

    def _end_late_handshakes(self) -> None:
        """Shut down every handshake past its deadline (its thread then fails and closes it)."""
        now = time.monotonic()
        with self._lock:
            late = [h for h in self._handshakes if not h.ended and now >= h.deadline]
            for h in late:
                h.ended = "no handshake within handshake_timeout_s"
        for h in late:
            _end(h.sock)

    def _serve_conn(self, handshake: _Handshake) -> None:
        conn, authenticated = handshake.sock, False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._wrap(handshake, self._tls)
            protocol.set_timeout(conn, _left(handshake))
            if not protocol.server_handshake(conn, self._secret, self._fp, self._row_bytes):
                return
            authenticated = self._authenticate(handshake)
            if not authenticated:
                self._failures.failed("connections:full", PeerFailure("refused a data connection (limit)"))
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
            self._refused(f"refused a data connection: {e}")
        except protocol.ProtocolError as e:
            self._book.count(TierCounter.MALFORMED)
            self._failures.failed("malformed:data", PeerFailure(f"closed a data connection: {e}"))
        except (OSError, ConnectionError):
            # the requester went away or idled out (it reconnects when it needs us), or its
            # handshake was ended: refused
            if not authenticated and (handshake.ended or time.monotonic() >= handshake.deadline):
                self._refused(f"closed a data connection: {handshake.ended or 'handshake timed out'}")
        finally:  # the TLS socket too when its handshake failed (`conn` is then the plain one)
            with self._lock:
                self._handshakes.discard(handshake)
                self._authenticated -= authenticated
                self._conns.difference_update((conn, handshake.sock))
            conn.close()
            handshake.sock.close()

    def _authenticate(self, handshake: _Handshake) -> bool:
        """Move a connection whose handshake passed to the authenticated ones: False when
        `max_connections` are taken. Raises AuthError when the handshake was ended meanwhile."""
        with self._lock:
            self._handshakes.discard(handshake)
            if handshake.ended:
                raise protocol.AuthError(handshake.ended)
            if self._authenticated >= self._max_connections:
                return False
            self._authenticated += 1
            return True

    def _refused(self, why: str) -> None:
        self._book.count(TierCounter.AUTH_REFUSED)
        self._failures.failed("auth:data", PeerFailure(why))

    def _wrap(self, handshake: _Handshake, tls: Tls) -> socket.socket:
        """The connection after the TLS handshake, in place of the plain socket among the
        connections `close` ends and as the one its deadline shuts down (the plain one is detached
        by the wrap). A handshake that fails (no TLS, a certificate the fleet CA did not sign) or
        does not end by the deadline raises AuthError."""
        wrapped = tls.wrap_server(handshake.sock)
        with self._lock:
            self._conns.discard(handshake.sock)
            self._conns.add(wrapped)
            handshake.sock = wrapped
            if handshake.ended:
                raise protocol.AuthError(handshake.ended)
        try:
            wrapped.settimeout(_left(handshake))
            wrapped.do_handshake()
        except ssl.SSLError as e:
            raise protocol.AuthError(f"TLS handshake failed ({e.reason})") from None
        except OSError:
            why = handshake.ended or "no TLS handshake within handshake_timeout_s"
            raise protocol.AuthError(why) from None
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
        chunkfmt.pack_header_digest(
            head[protocol.BLOCK :], key, self._fp, self._row_bytes, claim.digest, self._fleet)
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
                _end(conn)
        for t in self._threads:
            t.join()


def _left(handshake: _Handshake) -> float:
    """The time left to `handshake`'s deadline, at least 1 ms (a timeout of 0 means non-blocking)."""
    return max(handshake.deadline - time.monotonic(), 0.001)


def _end(sock: socket.socket) -> None:
    """Shut `sock` down so that its serving thread's blocked call returns (the thread closes it);
    the plain call even on a TLS socket, leaving OpenSSL's state to the serving thread."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
