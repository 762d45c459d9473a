"""`P2PTier`: the p2p secondary tier (see the package docstring for the design)."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import zmq

from kvtier.errors import ConfigError
from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import Job, LookupResult, TierContext, TierUsage
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog
from kvtier.tiers.common.io_tier import BookedTier
from kvtier.tiers.common.iopool import IoPool, JobTracker
from kvtier.tiers.common.options import Kind, Option, check_options, count, hidden, seconds, word
from kvtier.tiers.p2p import protocol
from kvtier.tiers.p2p.auth import Secret, load_secret
from kvtier.tiers.p2p.curve import Curve, CurveGate, load_curve
from kvtier.tiers.p2p.discovery import Discovery
from kvtier.tiers.p2p.fetch import Fetcher, Request
from kvtier.tiers.p2p.index import ChunkIndex, Claim
from kvtier.tiers.p2p.lookup import PeerLookup
from kvtier.tiers.p2p.row_server import P2PServer
from kvtier.tiers.p2p.tls import Tls, load_tls

BATCH_BYTES = 16 << 20
"""About how many bytes of rows one data request asks for (between 1 and MAX_FETCH_KEYS keys)."""


PIPELINE = 2
"""Data requests a load thread keeps asked for at once."""


class _Sent(NamedTuple):
    """A batch of keys asked of one holder (request None: no holder known or reachable)."""

    request: Request | None
    holder: str | None
    entries: list[tuple[JobTracker, int]]


class _Closable(Protocol):
    def close(self) -> None: ...


def _is_tcp(address: str) -> bool:
    return urlsplit(address).scheme == "tcp" and ":" in address[6:]


TCP_ADDRESS = "must be a ZMQ TCP address like tcp://HOST:PORT"


class P2PTier(BookedTier):
    """Serves this instance's host tier to peers, and loads chunks that peers' host tiers hold."""

    medium = "CPU"
    locality = "REMOTE"
    loads_own_stores = False
    OPTIONS = (
        Option("secret", Kind.TEXT, show=hidden),
        Option("secret_file", Kind.TEXT),
        Option("curve_secret_key", Kind.TEXT, show=hidden),
        Option("curve_secret_key_file", Kind.TEXT),
        Option("tls_cert_file", Kind.TEXT),
        Option("tls_key_file", Kind.TEXT),
        Option("tls_ca_file", Kind.TEXT),
        Option("listen", Kind.TEXT, "tcp://127.0.0.1:0", test=_is_tcp, allowed=TCP_ADDRESS),
        Option("peers", Kind.TEXTS, (), test=_is_tcp,
               allowed="must be a list of tcp://HOST:PORT addresses"),
        Option("discovery_url", Kind.TEXT, show=hidden),
        Option("discovery_prefix", Kind.TEXT, "kvtier-p2p", test=word,
               allowed="must be a non-empty string without spaces"),
        seconds("discovery_ttl_s", 10.0),
        Option("advertise", Kind.TEXT, test=_is_tcp, allowed=TCP_ADDRESS),
        count("io_threads", 4, 256),
        seconds("lookup_timeout_s", 0.5),
        seconds("lookup_ttl_s", 1.0),
        seconds("connect_timeout_s", 2.0),
        seconds("transfer_timeout_s", 5.0),
        seconds("reconnect_interval_s", 1.0),
        count("max_connections", 64, 4096),
        count("max_handshakes", 16, 4096),
        count("max_handshakes_per_address", 4, 4096),
        seconds("handshake_timeout_s", 5.0),
        seconds("idle_timeout_s", 300.0),
    )
    """`secret` or `secret_file` (shared by every peer; required, at least 16 bytes),
    `curve_secret_key` or `curve_secret_key_file` (optional: the fleet's ZMQ CURVE secret key, Z85;
    see `curve`), `tls_cert_file`, `tls_key_file` and `tls_ca_file` (optional, all three: mutual
    TLS on the data connections with the fleet CA's certificates; see `tls`), `listen` (ZMQ address
    to bind; port 0 picks a free one), `peers` (static list of peers' `listen` addresses; our own is
    ignored), `discovery_url` (a redis URL: peers register
    there and read each other; with `discovery_prefix`, `discovery_ttl_s`, and `advertise`, the
    address peers should use when `listen` binds a wildcard), `io_threads` (concurrent loads),
    `lookup_timeout_s` (a silent peer's answer counts as a miss after this), `lookup_ttl_s` (how
    long answers are reused), `connect_timeout_s`, `transfer_timeout_s` (a stalled holder fails its
    keys after this), `reconnect_interval_s` (a failing holder is skipped this long),
    `max_connections` (authenticated data connections), `max_handshakes` and
    `max_handshakes_per_address` (connections still authenticating, in all and from one address),
    `handshake_timeout_s` (a deadline from accept to authenticated) and `idle_timeout_s` (the
    serving side's limits; see `row_server`)."""

    def __init__(self, ctx: TierContext, **options: Any) -> None:
        super().__init__(ctx)
        o = check_options(self.OPTIONS, options)
        key = load_secret(o["secret"], o["secret_file"])
        curve = load_curve(o["curve_secret_key"], o["curve_secret_key_file"])
        tls = load_tls(o["tls_cert_file"], o["tls_key_file"], o["tls_ca_file"])
        self._failures = FailureLog(ctx.log, f"p2p tier {ctx.tier_name}")
        if ctx.generations is None:
            raise ValueError("the p2p tier serves host rows only from a region with slot generations")
        self._generations = ctx.generations
        self._index = ChunkIndex(ctx.num_slots)
        self._batch_keys = max(1, min(protocol.MAX_FETCH_KEYS, BATCH_BYTES // ctx.row_bytes))
        self._threads = o["io_threads"]
        self._pending: deque[tuple[JobTracker, int]] = deque()
        self._draining = 0
        """Drain tasks queued or running: a job starts more only up to one per pending key and
        `io_threads` in all (one task per job woke a thread per job, mostly to find nothing)."""
        self._pending_lock = threading.Lock()
        self._closing = False
        self._instance_id = os.urandom(16)
        self._zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._built: list[_Closable] = []
        try:
            self._serve(o, key, curve, tls)
            self._ask_peers(o, key, curve, tls)
            self._load_pool = IoPool(self._threads, 0, f"kvtier-p2p-{ctx.tier_name}-load")
            self._store_pool = IoPool(0, 1, f"kvtier-p2p-{ctx.tier_name}-store")
        except BaseException:
            self.shutdown()
            raise
        ctx.log.info("p2p tier %s listening on %s (data port %d), %d static peers%s",
                     ctx.tier_name, self.address, self._server.data_port, len(o["peers"]),
                     ", redis discovery" if o["discovery_url"] else "")

    def _serve(self, o: dict[str, Any], key: Secret, curve: Curve | None, tls: Tls | None) -> None:
        """Start the serving half (and the CURVE gate); ConfigError naming `listen` when it
        cannot bind. Constructor only."""
        if curve is not None:
            self._built.append(CurveGate(self._zctx, curve, self._book, self._failures))
        try:
            self._server = P2PServer(
                self._zctx, o["listen"], key, self._index, self.ctx.region, self._generations,
                self.ctx.row_bytes, self._fp, self._instance_id, self._book, self._failures,
                max_connections=o["max_connections"], handshake_timeout_s=o["handshake_timeout_s"],
                max_handshakes=o["max_handshakes"],
                max_handshakes_per_address=o["max_handshakes_per_address"],
                idle_timeout_s=o["idle_timeout_s"], transfer_timeout_s=o["transfer_timeout_s"],
                curve=curve, tls=tls, fleet=self.ctx.fleet_key,
            )
        except (zmq.ZMQError, OSError) as e:
            raise ConfigError("listen", o["listen"], f"cannot listen there: {e}") from None
        self.address = self._server.address
        self._built.append(self._server)

    def _ask_peers(self, o: dict[str, Any], key: Secret, curve: Curve | None,
                   tls: Tls | None) -> None:
        """Start the asking half: lookups, fetches, and discovery when configured. Constructor
        only, after `_serve`."""
        own = o["advertise"] or self.address
        self._lookup = PeerLookup(
            self._zctx, key, self._instance_id, self._fp, self.ctx.row_bytes, self._book,
            self._failures, lookup_timeout_s=o["lookup_timeout_s"], lookup_ttl_s=o["lookup_ttl_s"],
            own_address=own, curve=curve,
        )
        self._built.append(self._lookup)
        self._fetcher = Fetcher(
            key, self._fp, self.ctx.row_bytes, self._book, self._failures,
            connect_timeout_s=o["connect_timeout_s"], transfer_timeout_s=o["transfer_timeout_s"],
            reconnect_interval_s=o["reconnect_interval_s"], tls=tls, fleet=self.ctx.fleet_key,
        )
        self._built.append(self._fetcher)
        peers = list(o["peers"])
        if o["discovery_url"] is not None:
            self._built.append(Discovery(
                o["discovery_url"], o["discovery_prefix"], self.ctx.layout_fingerprint, own,
                o["discovery_ttl_s"], peers, self._lookup.set_peers, self._book, self._failures,
            ))
        self._lookup.set_peers(peers)

    # ---- the contract (dispatch thread) ------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[LookupResult]:
        return self._lookup.lookup(keys)

    def submit_store(self, job: Job) -> None:
        tracker = self._book.track(job)
        if tracker is not None and not self._store_pool.submit(
                False, [partial(self._store_key, tracker, i) for i in range(len(job.keys))]):
            for i in range(len(job.keys)):
                self._book.finish_key(tracker, i, False)

    def submit_load(self, job: Job) -> None:
        """Queue the job's keys for the load threads (which batch them per holder), and ask peers
        now about keys whose holder is not known yet, so the answers are there when a thread
        takes the keys."""
        tracker = self._book.track(job)
        if tracker is None:
            return
        self._lookup.lookup(job.keys)
        with self._pending_lock:
            self._pending.extend((tracker, i) for i in range(len(job.keys)))
            more = min(len(self._pending), self._threads) - self._draining
            self._draining += max(more, 0)
        if more > 0 and not self._load_pool.submit(True, [self._drain_loads] * more):
            with self._pending_lock:
                self._draining -= more - 1
            self._drain_loads()

    def usage(self) -> TierUsage:
        """The host-tier rows this instance offers to peers (claims, not copies), out of the host
        region's rows (the index holds at most one claim per slot)."""
        chunks, row_bytes = len(self._index), self.ctx.row_bytes
        return TierUsage(chunks * row_bytes, chunks, self.ctx.num_slots * row_bytes)

    def _gauges(self) -> dict[TierGauge, float]:
        """The peers known, the connections served, and whether the data server is down (its
        accept thread gone or failing: `P2PServer.healthy`)."""
        return {TierGauge.PEERS: float(len(self._lookup.peers())),
                TierGauge.SERVING_CONNECTIONS: float(self._server.connections()),
                TierGauge.SERVER_DOWN: float(not self._server.healthy())}

    def endpoints(self) -> dict[str, str]:
        """"control": the ZMQ address peers send lookups to; "data": tcp://HOST:PORT of the data
        listener (peers learn its port from lookup answers)."""
        host = urlsplit(self.address).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return {"control": self.address, "data": f"tcp://{host}:{self._server.data_port}"}

    def shutdown(self) -> None:
        """Fail in-flight loads, stop the I/O threads, then every component in reverse. Idempotent."""
        if hasattr(self, "_fetcher"):
            self._fetcher.close()  # a load blocked on a holder fails at once
        self._closing = True
        for name in ("_load_pool", "_store_pool"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.shutdown()
                delattr(self, name)
        for part in reversed(self._built):
            part.close()
        self._built.clear()
        self._zctx.term()

    # ---- I/O threads -------------------------------------------------------------------------

    def _store_key(self, tracker: JobTracker, i: int) -> None:
        """Remember where the host tier holds the key, with its digest (its checksum, or with the
        fleet key its MAC) and the slot's generation (stable: the slot is pinned while the STORE
        job is in flight): nothing is copied."""
        slot = tracker.job.slots[i]
        generation = self._generations[slot]
        key = tracker.job.keys[i]
        digest = chunkfmt.digest_of(key, self._fp, self.ctx.slot_view(slot), self.ctx.fleet_key)
        self._index.remember(key, Claim(slot, digest, generation))
        self._book.finish_key(tracker, i, True)

    def _drain_loads(self) -> None:
        """Load pending keys until none is left, a batch at a time: this thread's share of the
        queue, at most `_batch_keys` (about BATCH_BYTES of rows, so threads that run out of work
        early find some left to share), one request per holder. Up to PIPELINE batches are asked
        for before the oldest is read, so a holder has the next request when it finishes one.
        After shutdown, keys fail at once."""
        inflight: deque[_Sent] = deque()
        counted = True
        try:
            while True:
                batch = self._take_batch(idle=not inflight) if len(inflight) < PIPELINE else []
                if batch is None:
                    counted = False
                    return
                if batch:
                    groups: dict[str | None, list[tuple[JobTracker, int]]] = {}
                    for tracker, i in batch:
                        holder = None if self._closing else self._lookup.locate(tracker.job.keys[i])
                        groups.setdefault(holder, []).append((tracker, i))
                    inflight.extend(self._send(holder, entries) for holder, entries in groups.items())
                    continue
                self._complete(inflight.popleft())
        finally:
            if counted:  # left by an exception: no longer draining either
                with self._pending_lock:
                    self._draining -= 1

    def _take_batch(self, idle: bool) -> list[tuple[JobTracker, int]] | None:
        """This thread's share of the pending keys; None, counting the thread out of the drainers,
        when none is pending and the thread has nothing in flight (`idle`): a job queued after that
        starts a drainer again."""
        with self._pending_lock:
            if idle and not self._pending:
                self._draining -= 1
                return None
            share = -(-len(self._pending) // self._threads)
            return [self._pending.popleft() for _ in range(min(share, self._batch_keys))]

    def _send(self, holder: str | None, entries: list[tuple[JobTracker, int]]) -> _Sent:
        address = None if holder is None or self._closing else self._lookup.data_address(holder)
        items = [(t.job.keys[i], self.ctx.slot_view(t.job.slots[i])) for t, i in entries]
        return _Sent(None if address is None else self._fetcher.send(address, items), holder, entries)

    def _complete(self, sent: _Sent) -> None:
        oks = [False] * len(sent.entries) if sent.request is None else self._fetcher.complete(sent.request)
        for (tracker, i), ok in zip(sent.entries, oks, strict=True):
            if ok and sent.holder is not None:
                self._lookup.remember(tracker.job.keys[i], sent.holder)
            else:
                self._lookup.forget(tracker.job.keys[i])
            self._book.count(TierCounter.LOADED if ok else TierCounter.LOAD_FAILURES)
            self._book.finish_key(tracker, i, ok)
