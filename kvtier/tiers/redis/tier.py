"""The redis secondary tier: one Redis (or Valkey) string per chunk, shared by every instance using it.

A chunk is stored as the `chunkfmt` bytes (4 KiB header + host row) under the key
`<key_prefix>:<layout fingerprint>:<chunk key hex>`, optionally with a TTL (a load refreshes it, so
expiry follows last use). Instances pointing at one server (or one cluster) and prefix share chunks
without configuration. A Redis/Valkey Cluster (`urls`, or `url` of one of its nodes) spreads the
chunks over its nodes by key slot (`cluster`). A value that vanished (TTL, or the server's own
maxmemory eviction) is a miss; a value that fails verification is counted, removed and reported as
a failed key.

Threads: the dispatch thread calls the contract methods, which only queue work. `io_threads` I/O
threads move chunks in pipelined batches (up to `pipeline_depth` keys and about `batch_bytes`
bytes per round trip; a thread sends its next batch before it reads the replies to a batch of
stores, as long as work is queued); even-numbered threads take loads first and odd ones stores
first, and either takes the other kind when its own is empty. One lookup thread answers lookups
with pipelined EXISTS so they never wait behind bulk transfers. Each thread owns one connection
(to each node of a cluster).

The parts: `link` (connection pool, pipelined round trips, the server's up/down state), `cluster`
(the slot map, routing and redirects over one `link` per node), `values` (the stored form, batches
of SET/GET, verification), `wire` (RESP framing and gathered sends without copies); this
file holds the tier contract, the job queue (a `DualQueue`), the lookup queue, and the threads.

Failures are values: a key that could not be moved fails its job. A connection error or timeout marks
the server (a cluster: that node, whose keys only fail) down for `reconnect_interval_s`: meanwhile
its batches fail at once and lookups answer MISS;
then the next batch reconnects, so the tier recovers without a restart. Each failure cause is logged
once per `book.LOG_INTERVAL_S`. The password in `url` never appears in logs, errors or reprs; to
keep it out of the config altogether, `password_file` names a file holding it, read once at start.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import RedisError
from redis.utils import HIREDIS_AVAILABLE

from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkKey
from kvtier.ops.metrics import TierCounter, TierGauge
from kvtier.tiers.base import Job, JobKind, LookupResult, TierContext, TierUsage
from kvtier.tiers.common.answers import AnswerCache
from kvtier.tiers.common.book import TierBook
from kvtier.tiers.common.io_tier import BookedTier
from kvtier.tiers.common.iopool import DualQueue
from kvtier.tiers.common.options import Kind, Option, check_options, count, seconds, word
from kvtier.tiers.redis.cluster import ClusterLink
from kvtier.tiers.redis.link import Link, RedisLink
from kvtier.tiers.redis.values import ChunkStore, Item, Sent
from kvtier.tiers.redis.wire import redact_url

SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis", "rediss")


ROUNDS_IN_FLIGHT = 2
"""Rounds an I/O thread sends before it reads the oldest one's replies, while none is a load's: two
rounds of GETs in flight loaded 12% slower than one (128 x 2 MiB, 2 threads, 10 interleaved
repeats), the server holding the second round's replies."""


def _has_loads(in_flight: deque[Sent | list[Item]]) -> bool:
    return any(isinstance(r, Sent) and r.load for r in in_flight)


class _WorkQueue(DualQueue[Item]):
    """The tier's `DualQueue`, which a thread with a round in flight also asks without waiting."""

    def take_now(self, prefers_loads: bool, more: Callable[[int], bool]) -> list[Item]:
        """`take`, but empty at once when there is no work (or the queue is stopped)."""
        first, second = (self._loads, self._stores) if prefers_loads else (self._stores, self._loads)
        with self._cv:
            source = first or second
            if self._stopping or not source:
                return []
            batch = [source.popleft()]
            while source and more(len(batch)):
                batch.append(source.popleft())
            return batch


def _shown_url(url: object) -> object:
    if isinstance(url, list | tuple):
        return [_shown_url(u) for u in url]
    return redact_url(url) if isinstance(url, str) else url


def _read_password(path: str | None, url: str | None, urls: Sequence[str] | None) -> str | None:
    """The password in the file `path` (its first line; None when `path` is None); ConfigError
    naming `password_file` when it cannot be read, is empty, or a URL carries a password too."""
    if path is None:
        return None
    for u in [url] if urls is None else urls:
        if u is not None and (urlsplit(u).password or "password=" in urlsplit(u).query.lower()):
            raise ConfigError("password_file", path, "a URL already gives a password: give it in "
                              "one place")
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError("password_file", path, f"cannot be read: {why}") from None
    if not password:
        raise ConfigError("password_file", path, "holds no password (its first line is empty)")
    return password


def _open_link(o: dict[str, Any], book: TierBook, on_down: Callable[[], None]) -> Link:
    """The link to the server or cluster the checked options `o` name (see `RedisTier.OPTIONS`);
    ConfigError naming the option when they do not name one, or name the wrong kind."""
    url, urls, cluster = o["url"], o["urls"], o["cluster"]
    if url is None and urls is None:
        raise ConfigError("url", None, "required (a redis://, rediss:// or unix:// URL), or urls "
                          "(seed nodes of a cluster)")
    if url is not None and urls is not None:
        raise ConfigError("urls", _shown_url(urls), "give either url or urls, not both")
    if urls is not None and (cluster is False or not urls):
        why = "must name at least one seed node" if not urls else "name a cluster: cluster must be true"
        raise ConfigError("urls", _shown_url(urls), why)
    if cluster and url is not None and urlsplit(url).scheme not in CLUSTER_SCHEMES:
        raise ConfigError("url", _shown_url(url), "a cluster is reached over TCP: must be a redis:// "
                          "or rediss:// URL")
    kwargs: dict[str, Any] = dict(
        connections=o["io_threads"] + 2, socket_timeout_s=o["socket_timeout_s"],
        connect_timeout_s=o["connect_timeout_s"], reconnect_interval_s=o["reconnect_interval_s"],
        book=book, on_down=on_down, password=_read_password(o["password_file"], url, urls))
    if urls is not None or cluster:
        return ClusterLink(urls or [url], option="url" if urls is None else "urls", **kwargs)
    link = RedisLink(url, **kwargs)
    if not _is_cluster_node(link):
        return link
    link.close()
    if cluster is False:
        raise ConfigError("cluster", False, f"{link.url} is a node of a Redis/Valkey Cluster: set "
                          "cluster to true (or leave it out)")
    if urlsplit(url).scheme not in CLUSTER_SCHEMES:
        raise ConfigError("url", link.url, "is a node of a Redis/Valkey Cluster, which is reached "
                          "over TCP: give its redis:// or rediss:// URL")
    return ClusterLink([url], option="url", **kwargs)


def _is_cluster_node(link: RedisLink) -> bool:
    """Whether the server says it is a cluster node (a server that will not say is taken as not)."""
    try:
        info = link.ask("INFO", "cluster")
    except (RedisError, OSError):
        return False
    return isinstance(info, bytes) and b"cluster_enabled:1" in info


class RedisTier(BookedTier):
    """Chunks as Redis strings under `<key_prefix>:<layout fingerprint>:`, shared by every instance."""

    medium = "CPU"
    locality = "REMOTE"
    OPTIONS = (
        Option("url", Kind.TEXT, test=lambda url: urlsplit(url).scheme in SCHEMES,
               allowed="must be a redis://, rediss:// or unix:// URL", show=_shown_url),
        Option("urls", Kind.TEXTS, test=lambda url: urlsplit(url).scheme in CLUSTER_SCHEMES,
               allowed="must be a list of redis:// or rediss:// URLs (seed nodes of a cluster)",
               show=_shown_url),
        Option("password_file", Kind.TEXT),
        Option("cluster", Kind.BOOL, None),
        Option("key_prefix", Kind.TEXT, "kvtier", test=word,
               allowed="must be a non-empty string without spaces"),
        seconds("ttl_s", None),
        count("io_threads", 4, 256),
        count("pipeline_depth", 16, 4096),
        Option("batch_bytes", Kind.NUMBER, 8 << 20, low=1, unit="bytes"),
        seconds("socket_timeout_s", 5.0),
        seconds("connect_timeout_s", 2.0),
        seconds("reconnect_interval_s", 0.5, low=0),
        seconds("lookup_ttl_s", 1.0),
        seconds("lookup_wait_s", 0.005, low=0),
    )
    """`url` (redis://, rediss:// or unix://; its query arguments such as `ssl_ca_certs` are
    redis-py's) or `urls` (seed nodes of a Redis/Valkey Cluster), `password_file` (a file whose
    first line is the server's password, read at start; the URLs then give none), `cluster`
    (null: a cluster when `urls` is given or `url` is a cluster node; true: `url` must be one;
    false: it must not be),
    `key_prefix`, `ttl_s` (null: no expiry), `io_threads`, `pipeline_depth` and
    `batch_bytes` (a batch's bound in keys and bytes), `socket_timeout_s` and `connect_timeout_s`
    (how long a dead or hung server can hold a batch), `reconnect_interval_s` (how long the server
    stays marked down after a connection error), `lookup_ttl_s` (how long an answer is reused) and
    `lookup_wait_s` (how long `lookup` waits for answers before saying RETRY)."""

    def __init__(self, ctx: TierContext, **options: Any) -> None:
        super().__init__(ctx)
        o = check_options(self.OPTIONS, options)
        px = None if o["ttl_s"] is None else str(max(1, round(o["ttl_s"] * 1000))).encode()
        self.pipeline_depth = o["pipeline_depth"]
        self.batch_bytes = int(o["batch_bytes"])
        self.lookup_wait_s = float(o["lookup_wait_s"])
        self._lock = threading.Lock()
        self._answers = AnswerCache(float(o["lookup_ttl_s"]))
        """Lookup answers and the keys being asked. Lock held."""
        self._link = _open_link(o, self._book, self._forget_answers)
        self.url = self._link.url
        self._chunks = ChunkStore(ctx, self._link, self._book, self._fp, o["key_prefix"], px,
                                  self._remember)
        self.value_bytes = self._chunks.value_bytes
        self._answered = threading.Condition(self._lock)
        self._asked = threading.Condition(self._lock)
        self._work = _WorkQueue()
        self._lookups: deque[bytes] = deque()
        self._stopping = False
        self._closed = False
        name = f"kvtier-redis-{ctx.tier_name}"
        self._threads = [threading.Thread(target=self._lookup_loop, name=f"{name}-lookup", daemon=True)]
        self._threads += [
            threading.Thread(target=self._io_loop, args=(i % 2 == 0,), name=f"{name}-{i}", daemon=True)
            for i in range(o["io_threads"])
        ]
        for t in self._threads:
            t.start()

    def __repr__(self) -> str:
        return f"RedisTier({self.ctx.tier_name!r}, url={self.url!r})"

    # ---- contract ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> list[LookupResult]:
        """Known answers (kept `lookup_ttl_s`); unknown keys are asked in one batch and answer RETRY
        unless the answer arrives within `lookup_wait_s`."""
        deadline = time.monotonic() + self.lookup_wait_s
        with self._lock:
            out = self._known(keys, ask=True)
            while LookupResult.RETRY in out and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0 or not self._answered.wait(left):
                    break
                out = self._known(keys, ask=False)
        return out

    def submit_store(self, job: Job) -> None:
        self._submit(job)

    def submit_load(self, job: Job) -> None:
        self._submit(job)

    def usage(self) -> TierUsage:
        """The chunks this instance stored or loaded and still knows of (others' are not seen; the
        server's own bound, if any, is not known here)."""
        held = self._chunks.held()
        return TierUsage(held * self.value_bytes, held)

    def _gauges(self) -> dict[TierGauge, float]:
        return {TierGauge.HIREDIS: float(HIREDIS_AVAILABLE),
                TierGauge.SERVER_DOWN: float(self._link.any_down())}

    def shutdown(self) -> None:
        """Fail the queued keys, let the batches in flight finish, close connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopping = True
            abandoned = self._work.stop()
            self._asked.notify_all()
            self._answered.notify_all()
        for tracker, i in abandoned:
            self._book.finish_key(tracker, i, False)
        for t in self._threads:
            t.join()
        self._link.close()

    # ---- jobs and lookups (dispatch thread) --------------------------------------------------

    def _submit(self, job: Job) -> None:
        tracker = self._book.track(job)
        if tracker is None:
            return
        if not self._work.put(job.kind is JobKind.LOAD, [(tracker, i) for i in range(len(job.keys))]):
            for i in range(len(job.keys)):
                self._book.finish_key(tracker, i, False)

    def _known(self, keys: Sequence[ChunkKey], ask: bool) -> list[LookupResult]:
        """Answers from the cache, RETRY for the others (queued for asking when `ask`); MISS for all
        while the server is marked down. Lock held."""
        if self._link.is_down():
            return [LookupResult.MISS] * len(keys)
        out, new = self._answers.lookup(keys, time.monotonic(), ask=ask)
        if new:
            self._lookups.extend(new)
            self._asked.notify()
        return out

    def _remember(self, keys: Sequence[bytes], result: LookupResult) -> None:
        """Answers from the lookup thread, or what a batch proved (I/O threads)."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._answers.put(key, result, now)
                self._answers.unask(key)
            self._answered.notify_all()

    def _forget_answers(self) -> None:
        """The server was marked down: what it held before may be gone (a restart)."""
        with self._lock:
            self._answers.forget()

    # ---- worker threads ----------------------------------------------------------------------

    def _lookup_loop(self) -> None:
        conn: Any = self._link.connection()
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._lookups):
                        self._asked.wait()
                    if self._stopping:
                        return
                    n = min(len(self._lookups), 1024)
                    keys = [self._lookups.popleft() for _ in range(n)]
                self._run_lookups(conn, keys)
        finally:
            conn.disconnect()

    def _run_lookups(self, conn: Any, keys: list[bytes]) -> None:
        self._book.count(TierCounter.LOOKUPS, len(keys))
        rkeys = [self._chunks.rkey(k) for k in keys]
        replies = self._link.pipeline(conn, "lookup", rkeys, [("EXISTS", rkey) for rkey in rkeys])
        hits = [k for k, r in zip(keys, replies, strict=True) if r == 1]
        # Unanswerable (server down, errors) is MISS: the engine recomputes instead of waiting.
        self._remember(hits, LookupResult.HIT)
        self._remember([k for k, r in zip(keys, replies, strict=True) if r != 1], LookupResult.MISS)

    def _io_loop(self, prefers_loads: bool) -> None:
        """Send a batch; while fewer than `ROUNDS_IN_FLIGHT` are unread and none is a load's, send
        the next one queued before reading the oldest's replies (the server keeps reading stores
        while this thread turns around)."""
        conn: Any = self._link.connection()
        in_flight: deque[Sent | list[Item]] = deque()

        def more(n: int) -> bool:
            return n < self.pipeline_depth and n * self.value_bytes < self.batch_bytes

        try:
            while True:
                if not in_flight or (len(in_flight) < ROUNDS_IN_FLIGHT and not _has_loads(in_flight)):
                    batch = (self._work.take_now(prefers_loads, more) if in_flight
                             else self._work.take(prefers_loads, more))
                    if batch:
                        in_flight.append(self._start(conn, batch))
                        continue
                    if not in_flight:
                        return  # stopping
                done = in_flight.popleft()
                outcomes = self._finish(conn, done)
                for (tracker, i), ok in zip(done if isinstance(done, list) else done.batch, outcomes,
                                            strict=True):
                    self._book.finish_key(tracker, i, ok)
        finally:
            conn.disconnect()

    def _start(self, conn: Any, batch: list[Item]) -> Sent | list[Item]:
        """The round sent for `batch`, or the batch itself when sending it failed unexpectedly."""
        try:
            return self._chunks.start(conn, batch)
        except Exception as e:  # a bug must fail the keys, never lose the jobs or the thread
            self._bug(conn, batch, e)
            return batch

    def _finish(self, conn: Any, done: Sent | list[Item]) -> list[bool]:
        if isinstance(done, list):
            return [False] * len(done)
        try:
            return self._chunks.finish(done)
        except Exception as e:  # a bug must fail the keys, never lose the jobs or the thread
            self._bug(conn, done.batch, e)
            return [False] * len(done.batch)

    def _bug(self, conn: Any, batch: list[Item], e: Exception) -> None:
        conn.disconnect()
        self._link.faillog.failed(f"{batch[0][0].job.kind.value}:{type(e).__name__}", e)
