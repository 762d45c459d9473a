"""The asking half of p2p lookups: which peer holds which chunks, answered asynchronously.

The dispatch thread calls `lookup`: cached answers are returned, unknown keys answer RETRY and are
queued. One lookup thread owns a ZMQ DEALER per peer (ZMQ sockets are not shared between threads; each is
a CURVE client when `curve` is configured):
it sends each batch of queued keys (at most MAX_LOOKUP_KEYS) to every peer at once and collects the
answers until all peers answered or `lookup_timeout_s` passed. A key is HIT when some peer holds it
(the first such peer is remembered as its holder, for loads), else MISS; a peer that did not answer
counts as holding nothing. Answers are cached for `lookup_ttl_s`, then asked again. A load's
outcome also updates the cache: a key loaded is held by its holder (`remember`); a key that failed
is forgotten (`forget`), whether its cached holder failed to give it or a cached "nobody" made the
load fail without asking, so the next lookup or load asks the peers again rather than trusting an
answer the failure proved stale (a failed load never makes a "nobody" outlive its `lookup_ttl_s`).
A load whose key has no cached answer (it expired, was forgotten, or the engine's own cache
answered) asks and waits for the answer on its I/O thread (`locate`).

The peer set can change at any time (`set_peers`, from discovery); the lookup thread applies it
before its next batch. Peers whose instance id is ours (our own address in a shared list) are
ignored. A peer's data port is learnt from its answers (`data_address`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

import zmq

from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import LookupResult
from kvtier.tiers.common.answers import AnswerCache
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.curve import Curve
from kvtier.tiers.p2p.protocol import PeerFailure


class PeerLookup:
    def __init__(
        self, zctx: zmq.Context[zmq.Socket[bytes]], secret: Secret, instance_id: bytes,
        layout_fp: bytes, row_bytes: int, book: TierBook, failures: FailureLog, *, lookup_timeout_s: float,
        lookup_ttl_s: float, own_address: str, curve: Curve | None = None,
    ) -> None:
        self._curve = curve
        self._zctx = zctx
        self._secret = secret
        self._instance_id = instance_id
        self._fp = layout_fp
        self._row_bytes = row_bytes
        self._book = book
        self._failures = failures
        self._timeout_s = lookup_timeout_s
        self._own = own_address
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._answered = threading.Condition(self._lock)
        self._queue: deque[bytes] = deque()
        self._answers = AnswerCache(lookup_ttl_s)
        """Answers, each with the peer holding the key (None for a MISS). Lock held."""
        self._wanted_peers: list[str] | None = None
        self._data_ports: dict[str, int] = {}
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._next_req = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvtier-p2p-lookup", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------

    def set_peers(self, addresses: Sequence[str]) -> None:
        with self._cv:
            self._wanted_peers = [a for a in dict.fromkeys(addresses) if a != self._own]
            self._cv.notify()

    def peers(self) -> list[str]:
        """Peers that answered at least once (their data port is known)."""
        with self._lock:
            return list(self._data_ports)

    def lookup(self, keys: Sequence[bytes]) -> list[LookupResult]:
        """Cached answers; RETRY for the others, queued for the lookup thread."""
        with self._cv:
            out, ask = self._answers.lookup(keys, time.monotonic())
            self._queue.extend(ask)
            if self._queue:
                self._cv.notify()
        return out

    def locate(self, key: bytes) -> str | None:
        """The peer holding `key`: the cached answer, else asked now (I/O threads only: this waits
        up to about `lookup_timeout_s` for the lookup thread's answer)."""
        self.lookup([key])
        deadline = time.monotonic() + self._timeout_s + 0.5
        with self._cv:
            while (answer := self._answers.get(key)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return None
                self._answered.wait(left)
            return answer[1]

    def remember(self, key: bytes, holder: str) -> None:
        """What a load proved: `holder` had the key."""
        with self._lock:
            self._put(key, holder, time.monotonic())

    def forget(self, key: bytes) -> None:
        """A load of `key` failed: whatever was cached about it is stale; the next use asks."""
        with self._lock:
            self._answers.drop(key)

    def _put(self, key: bytes, holder: str | None, now: float) -> None:
        """Remember who holds `key` (None: nobody). Lock held."""
        self._answers.put(key, LookupResult.MISS if holder is None else LookupResult.HIT, now, holder)

    def data_address(self, peer: str) -> tuple[str, int] | None:
        with self._lock:
            port = self._data_ports.get(peer)
        host = urlsplit(peer).hostname
        return None if port is None or host is None else (host, port)

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
            self._answered.notify_all()
        self._thread.join()

    # ---- the lookup thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._queue or self._wanted_peers is not None):
                        self._cv.wait()
                    if self._stopping:
                        return
                    wanted, self._wanted_peers = self._wanted_peers, None
                    n = min(len(self._queue), protocol.MAX_LOOKUP_KEYS)
                    keys = [self._queue.popleft() for _ in range(n)]
                if wanted is not None:
                    self._apply_peers(wanted)
                if keys:
                    self._ask(keys)
        finally:
            for sock in self._peers.values():
                sock.close()

    def _apply_peers(self, wanted: list[str]) -> None:
        for addr in set(self._peers) - set(wanted):
            self._peers.pop(addr).close()
            with self._lock:
                self._data_ports.pop(addr, None)
        for addr in wanted:
            if addr in self._peers:
                continue
            sock = self._zctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_CONTROL_BYTES)
            if self._curve is not None:
                self._curve.make_client(sock)
            try:
                sock.connect(addr)
            except zmq.ZMQError as e:
                sock.close()
                self._failures.failed("peer:address", PeerFailure(f"cannot use peer {addr}: {e}"))
                continue
            self._peers[addr] = sock

    def _ask(self, keys: list[bytes]) -> None:
        self._next_req += 1
        req = self._next_req
        frames = protocol.encode_control(self._secret, protocol.OP_LOOKUP, req, self._instance_id,
                                         self._fp, self._row_bytes, b"".join(keys), len(keys))
        poller = zmq.Poller()
        waiting: dict[zmq.Socket[bytes], str] = {}
        for addr, sock in self._peers.items():
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                self._failures.failed("peer:unreachable", PeerFailure(f"peer {addr} is not connected"))
                continue
            poller.register(sock, zmq.POLLIN)
            waiting[sock] = addr
        holders: list[str | None] = [None] * len(keys)
        deadline = time.monotonic() + self._timeout_s
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                addr = waiting[sock]
                answer = self._read_answer(sock, addr, req, len(keys))
                if answer is None:
                    continue
                poller.unregister(sock)
                del waiting[sock]
                for i, held in enumerate(answer):
                    if held and holders[i] is None:
                        holders[i] = addr
        for addr in waiting.values():
            self._failures.failed("peer:timeout", PeerFailure(f"peer {addr} did not answer a lookup in time"))
        self._book.count(TierCounter.LOOKUPS, len(keys))
        now = time.monotonic()
        with self._lock:
            for key, holder in zip(keys, holders, strict=True):
                self._answers.unask(key)
                self._put(key, holder, now)
            self._answered.notify_all()

    def _read_answer(self, sock: zmq.Socket[bytes], addr: str, req: int, n: int) -> bytes | None:
        """The answer to request `req` read from `sock`, or None (stale, invalid or our own)."""
        frames = sock.recv_multipart()
        try:
            msg = protocol.decode_control(self._secret, frames)
        except (protocol.AuthError, protocol.ProtocolError) as e:
            self._failures.failed("peer:bad_answer", PeerFailure(f"peer {addr} sent an invalid answer: {e}"))
            return None
        if msg.op != protocol.OP_ANSWER or msg.request_id != req or msg.count != n:
            return None  # a late answer to an earlier request
        with self._lock:
            self._data_ports[addr] = msg.data_port
        if msg.instance_id == self._instance_id:
            return bytes(n)  # our own server, listed among the peers
        return msg.body
