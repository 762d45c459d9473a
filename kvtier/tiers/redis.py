"""The redis secondary tier: one Redis (or Valkey) string per chunk, shared by every instance using it.

A chunk is stored as the `chunkfmt` bytes (4 KiB header + host row) under the key
`<key_prefix>:<layout fingerprint>:<chunk key hex>`, optionally with a TTL (a load refreshes it, so
expiry follows last use). Instances pointing at one server and prefix share chunks without
configuration. A value that vanished (TTL, or the server's own maxmemory eviction) is a miss; a value
that fails verification is counted, removed and reported as a failed key.

Threads: the dispatch thread calls the contract methods, which only queue work. `io_threads` I/O
threads move chunks in pipelined batches (up to `pipeline_depth` keys and about `batch_bytes`
bytes per round trip); even-numbered threads take loads first and odd ones stores first, and either
takes the other kind when its own is empty. One lookup thread answers lookups with pipelined EXISTS
so they never wait behind bulk transfers. Each thread owns one connection.

Copies: a store sends the header and the host row as separate buffers of one hand-framed SET (the
row is never copied in Python); a load reads the GET reply's payload from the socket straight into
the slot (`redis_wire.ReplyReader`), then checks the header and checksum before reporting the key loaded.

Failures are values: a key that could not be moved fails its job. A connection error or timeout marks
the server down for `reconnect_interval_s`: meanwhile batches fail at once and lookups answer MISS;
then the next batch reconnects, so the tier recovers without a restart. Each failure cause is logged
once per `book.LOG_INTERVAL_S`. The password in `url` never appears in logs, errors or reprs.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url as _redis_parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

from kvtier.errors import ConfigError
from kvtier.tiers import chunkfmt
from kvtier.tiers.base import (
    ChunkKey,
    Job,
    JobKind,
    JobResult,
    LookupResult,
    SecondaryTier,
    TierContext,
    TierEvent,
    TierEventKind,
)
from kvtier.tiers.book import FailureLog, TierBook
from kvtier.tiers.iopool import JobTracker
from kvtier.tiers.redis_wire import ReplyReader, redact_url, set_command
from kvtier.tiers.registry import number_option

_parse_url = cast(Callable[[str], dict[str, Any]], _redis_parse_url)
"""redis-py's own URL parser (untyped there): scheme, host or path, credentials, query arguments."""
SCHEMES = ("redis", "rediss", "unix")
_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
_DELETE_IF_SAME = (
    "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then "
    "return redis.call('DEL', KEYS[1]) end return 0"
)
"""Delete a bad value only if it is still the one that was read (another instance may have
replaced it with a good copy meanwhile)."""

_Item = tuple[JobTracker, int]
"""One key of a job: the job's tracker and the key's index in it."""


class _NoReply:
    """The reply of a command that got none (connection error, server marked down)."""


NO_REPLY = _NoReply()


@dataclass(frozen=True)
class _Bad:
    """A load reply that is not a valid chunk of its key: why, and the SHA-1 of what was read."""

    reason: chunkfmt.ChunkError
    sha1: str


class RedisTier(SecondaryTier):
    """Chunks as Redis strings under `<key_prefix>:<layout fingerprint>:`, shared by every instance.

    Options: `url` (redis://, rediss:// or unix://; its query arguments such as `ssl_ca_certs` are
    redis-py's), `key_prefix`, `ttl_s` (None: no expiry), `io_threads`, `pipeline_depth` and
    `batch_bytes` (a batch's bound in keys and bytes), `socket_timeout_s` and `connect_timeout_s`
    (how long a dead or hung server can hold a batch), `reconnect_interval_s` (how long the server
    stays marked down after a connection error), `lookup_ttl_s` (how long an answer is reused) and
    `lookup_wait_s` (how long `lookup` waits for answers before saying RETRY).
    """

    def __init__(
        self,
        ctx: TierContext,
        *,
        url: str,
        key_prefix: str = "kvtier",
        ttl_s: float | None = None,
        io_threads: int = 4,
        pipeline_depth: int = 16,
        batch_bytes: int = 8 << 20,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        reconnect_interval_s: float = 0.5,
        lookup_ttl_s: float = 1.0,
        lookup_wait_s: float = 0.005,
    ) -> None:
        super().__init__(ctx)
        self._check_options(url, key_prefix, ttl_s, io_threads, pipeline_depth, batch_bytes,
                            socket_timeout_s, connect_timeout_s, reconnect_interval_s,
                            lookup_ttl_s, lookup_wait_s)
        self.url = redact_url(url)
        given = [urlsplit(url).password, dict(parse_qsl(urlsplit(url).query)).get("password")]
        self._secrets = {form for pw in given if pw for form in (pw, unquote(pw))}
        try:
            self._fp = chunkfmt.fingerprint_bytes(ctx.layout_fingerprint)
        except ValueError as e:
            raise ConfigError("layout_fingerprint", ctx.layout_fingerprint, str(e)) from None
        self._key_head = f"{key_prefix}:{ctx.layout_fingerprint}:".encode()
        self.value_bytes = chunkfmt.HEADER_BYTES + ctx.row_bytes
        self._px = None if ttl_s is None else str(max(1, round(ttl_s * 1000))).encode()
        self.pipeline_depth = pipeline_depth
        self.batch_bytes = int(batch_bytes)
        self.reconnect_interval_s = float(reconnect_interval_s)
        self.lookup_ttl_s = float(lookup_ttl_s)
        self.lookup_wait_s = float(lookup_wait_s)
        try:
            # Query arguments in the URL (ssl_ca_certs=..., socket_timeout=...) win, except the
            # ones the threading model depends on: one connection per thread, no hidden retries.
            kwargs: dict[str, Any] = {"socket_timeout": socket_timeout_s,
                                      "socket_connect_timeout": connect_timeout_s, **_parse_url(url)}
            kwargs.update(max_connections=io_threads + 2, retry=Retry(NoBackoff(), 0))
            self._pool = redis.ConnectionPool(**kwargs)
        except (ValueError, TypeError, RedisError) as e:
            raise ConfigError("url", self.url, self._scrub(f"not a usable redis URL: {e}")) from None
        self._probe()

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._answered = threading.Condition(self._lock)
        self._asked = threading.Condition(self._lock)
        self._loads: deque[_Item] = deque()
        self._stores: deque[_Item] = deque()
        self._lookups: deque[bytes] = deque()
        self._asking: set[bytes] = set()
        self._answers: OrderedDict[bytes, tuple[LookupResult, float]] = OrderedDict()
        self._book = TierBook(ctx)
        self._faillog = FailureLog(ctx.log, f"redis tier {ctx.tier_name} ({self.url})", self._scrub)
        self._down_until = 0.0
        self._down_cause = ""
        self._stopping = False
        self._closed = False
        name = f"kvtier-redis-{ctx.tier_name}"
        self._threads = [threading.Thread(target=self._lookup_loop, name=f"{name}-lookup", daemon=True)]
        self._threads += [
            threading.Thread(target=self._io_loop, args=(i % 2 == 0,), name=f"{name}-{i}", daemon=True)
            for i in range(io_threads)
        ]
        for t in self._threads:
            t.start()

    def __repr__(self) -> str:
        return f"RedisTier({self.ctx.tier_name!r}, url={self.url!r})"

    # ---- setup -------------------------------------------------------------------------------

    @staticmethod
    def _check_options(
        url: object, key_prefix: object, ttl_s: object, io_threads: object, pipeline_depth: object,
        batch_bytes: object, socket_timeout_s: object, connect_timeout_s: object,
        reconnect_interval_s: object, lookup_ttl_s: object, lookup_wait_s: object,
    ) -> None:
        if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
            shown = redact_url(url) if isinstance(url, str) else url
            raise ConfigError("url", shown, "must be a redis://, rediss:// or unix:// URL")
        if not isinstance(key_prefix, str) or not key_prefix or any(c.isspace() for c in key_prefix):
            raise ConfigError("key_prefix", key_prefix, "must be a non-empty string without spaces")
        if ttl_s is not None:
            number_option("ttl_s", ttl_s, "must be None or a positive number of seconds", low=1e-3)
        for name, value, high in (("io_threads", io_threads, 256),
                                  ("pipeline_depth", pipeline_depth, 4096)):
            if number_option(name, value, f"must be an integer from 1 to {high}", low=1, integer=True) > high:
                raise ConfigError(name, value, f"must be an integer from 1 to {high}")
        number_option("batch_bytes", batch_bytes, "must be a positive number of bytes", low=1)
        for name, value in (("socket_timeout_s", socket_timeout_s), ("lookup_ttl_s", lookup_ttl_s),
                            ("connect_timeout_s", connect_timeout_s)):
            number_option(name, value, "must be a positive number of seconds", low=1e-3)
        for name, value in (("reconnect_interval_s", reconnect_interval_s),
                            ("lookup_wait_s", lookup_wait_s)):
            number_option(name, value, "must be a non-negative number of seconds", low=0)

    def _scrub(self, text: str) -> str:
        """`text` without the password, should a message from below ever quote it."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _probe(self) -> None:
        """PING the server once; ConfigError naming `url` when it cannot be reached or refuses us."""
        conn: Any = self._pool.make_connection()
        try:
            conn.send_command("PING")
            reply = conn.read_response()
        except (RedisError, OSError) as e:
            self._pool.disconnect()
            why = f"redis server did not answer PING: {type(e).__name__}: {e}"
            raise ConfigError("url", self.url, self._scrub(why)) from None
        finally:
            conn.disconnect()
        if reply not in (b"PONG", "PONG"):
            raise ConfigError("url", self.url, f"unexpected PING reply {reply!r}")

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

    def get_finished_jobs(self) -> list[JobResult]:
        return self._book.take_finished()

    def take_events(self) -> list[TierEvent]:
        return self._book.take_events()

    def stats(self) -> dict[str, float]:
        with self._lock:
            down = time.monotonic() < self._down_until
        out = {"hiredis": float(HIREDIS_AVAILABLE), "down": float(down)}
        out.update(self._book.counters(
            "stored", "loaded", "store_failures", "load_failures", "load_misses", "bad_chunks",
            "lookups",
        ))
        return out

    def shutdown(self) -> None:
        """Fail the queued keys, let the batches in flight finish, close connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopping = True
            abandoned = [*self._loads, *self._stores]
            self._loads.clear()
            self._stores.clear()
            self._cv.notify_all()
            self._asked.notify_all()
            self._answered.notify_all()
        for tracker, i in abandoned:
            self._finish_key(tracker, i, False)
        for t in self._threads:
            t.join()
        self._pool.disconnect()

    # ---- jobs and lookups (dispatch thread) --------------------------------------------------

    def _submit(self, job: Job) -> None:
        tracker = JobTracker(job)
        if not job.keys:
            self._book.finish(tracker)
            return
        items = [(tracker, i) for i in range(len(job.keys))]
        with self._lock:
            if not self._stopping:
                (self._loads if job.kind is JobKind.LOAD else self._stores).extend(items)
                self._cv.notify(len(items))
                return
        for tracker, i in items:
            self._finish_key(tracker, i, False)

    def _known(self, keys: Sequence[ChunkKey], ask: bool) -> list[LookupResult]:
        """Answers from the cache, RETRY for the others (queued for asking when `ask`); MISS for all
        while the server is marked down. Lock held."""
        now = time.monotonic()
        if now < self._down_until:
            return [LookupResult.MISS] * len(keys)
        self._expire(now)
        out: list[LookupResult] = []
        queued = len(self._lookups)
        for key in keys:
            answer = self._answers.get(key)
            if answer is not None:
                out.append(answer[0])
                continue
            out.append(LookupResult.RETRY)
            if ask and key not in self._asking:
                self._asking.add(key)
                self._lookups.append(key)
        if len(self._lookups) > queued:
            self._asked.notify()
        return out

    def _expire(self, now: float) -> None:
        """Drop the cached answers older than `lookup_ttl_s`. Lock held."""
        while self._answers:
            first, (_, t) = next(iter(self._answers.items()))
            if now - t < self.lookup_ttl_s:
                break
            del self._answers[first]

    def _remember(self, keys: Sequence[bytes], result: LookupResult) -> None:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            for key in keys:
                self._answers[key] = (result, now)
                self._answers.move_to_end(key)
                self._asking.discard(key)
            self._answered.notify_all()

    # ---- worker threads ----------------------------------------------------------------------

    def _rkey(self, key: bytes) -> bytes:
        return self._key_head + key.hex().encode()

    def _lookup_loop(self) -> None:
        conn: Any = self._pool.make_connection()
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
        self._book.count("lookups", len(keys))
        replies = self._pipeline(conn, "lookup", [("EXISTS", self._rkey(k)) for k in keys])
        hits = [k for k, r in zip(keys, replies, strict=True) if r == 1]
        # Unanswerable (server down, errors) is MISS: the engine recomputes instead of waiting.
        self._remember(hits, LookupResult.HIT)
        self._remember([k for k, r in zip(keys, replies, strict=True) if r != 1], LookupResult.MISS)

    def _io_loop(self, prefers_loads: bool) -> None:
        conn: Any = self._pool.make_connection()
        first, second = (self._loads, self._stores) if prefers_loads else (self._stores, self._loads)
        try:
            while True:
                with self._lock:
                    while not (self._stopping or first or second):
                        self._cv.wait()
                    if self._stopping:
                        return
                    source = first if first else second
                    batch = [source.popleft()]
                    size = self.value_bytes
                    while source and len(batch) < self.pipeline_depth and size < self.batch_bytes:
                        batch.append(source.popleft())
                        size += self.value_bytes
                kind = batch[0][0].job.kind
                try:
                    run = self._run_loads if kind is JobKind.LOAD else self._run_stores
                    outcomes = run(conn, batch)
                except Exception as e:  # a bug must fail the keys, never lose the jobs or the thread
                    conn.disconnect()
                    self._faillog.failed(f"{kind.value}:{type(e).__name__}", e)
                    outcomes = [False] * len(batch)
                for (tracker, i), ok in zip(batch, outcomes, strict=True):
                    self._finish_key(tracker, i, ok)
        finally:
            conn.disconnect()

    def _pipeline(
        self, conn: Any, op: str, commands: list[Any],
        read_reply: Callable[[ReplyReader, int], Any] | None = None,
    ) -> list[Any]:
        """Send `commands` (argument tuples, or lists of pre-framed buffers) in one write, read one
        reply per command: the value, a ResponseError, or NO_REPLY when there was none (the server
        is down or was just marked down by a connection error). `read_reply(reader, n)`, when
        given, reads the reply to command `n` itself, straight from the socket."""
        with self._lock:
            if time.monotonic() < self._down_until:
                return [NO_REPLY] * len(commands)
        # A connection that broke while idle (the server restarted) gets one fresh try: every
        # command here is idempotent, and nothing of the first try's replies was used.
        was_connected = conn._sock is not None
        for attempt in range(2):
            replies: list[Any] = []
            try:
                buffers: list[Any] = []
                for cmd in commands:
                    buffers.extend(cmd if isinstance(cmd, list) else conn.pack_command(*cmd))
                conn.send_packed_command(buffers, check_health=False)
                if read_reply is not None:
                    reader = ReplyReader(conn._sock)  # connected by send_packed_command
                    for n in range(len(commands)):
                        replies.append(read_reply(reader, n))
                    reader.finish()
                for _ in range(len(commands) - len(replies)):
                    try:
                        replies.append(conn.read_response(disable_decoding=True))
                    except ResponseError as e:
                        replies.append(e)
            except _DOWN_ERRORS as e:
                conn.disconnect()
                stale = isinstance(e, RedisConnectionError | ConnectionError)
                if attempt == 0 and was_connected and stale and not replies:
                    continue
                self._mark_down(op, e)
            except Exception as e:  # a bug must fail the keys, never lose the jobs or the thread
                conn.disconnect()
                self._faillog.failed(f"{op}:{type(e).__name__}", e)
            else:
                self._mark_up()
            break
        return replies + [NO_REPLY] * (len(commands) - len(replies))

    def _run_stores(self, conn: Any, batch: list[_Item]) -> list[bool]:
        """Store a batch of keys in one round trip; whether each key was stored."""
        commands: list[Any] = []
        for tracker, i in batch:
            row = self.ctx.slot_view(tracker.job.slots[i])
            key = tracker.job.keys[i]
            header = chunkfmt.header_bytes(key, self._fp, row)
            commands.append(set_command(self._rkey(key), header, row, self._px))
        replies = self._pipeline(conn, "store", commands)
        outcomes = [reply == b"OK" for reply in replies]
        for reply in replies:
            if isinstance(reply, ResponseError):  # e.g. OOM: maxmemory with the noeviction policy
                self._faillog.failed(f"store:{str(reply).split(' ', 1)[0]}", reply)
        stored = [tracker.job.keys[i] for (tracker, i), ok in zip(batch, outcomes, strict=True) if ok]
        self._remember(stored, LookupResult.HIT)
        self._book.count("stored", len(stored))
        self._book.count("store_failures", len(batch) - len(stored))
        self._book.events(TierEventKind.STORED, stored)
        return outcomes

    def _run_loads(self, conn: Any, batch: list[_Item]) -> list[bool]:
        """Load a batch of keys in one round trip; whether each key's slot now holds its row."""
        verb = "GET" if self._px is None else "GETEX"
        extra = () if self._px is None else ("PX", self._px)
        keys = [tracker.job.keys[i] for tracker, i in batch]
        rows = [self.ctx.slot_view(tracker.job.slots[i]) for tracker, i in batch]

        def read(reader: ReplyReader, n: int) -> Any:
            return self._read_value(reader, keys[n], rows[n])

        commands = [(verb, self._rkey(k), *extra) for k in keys]
        replies = self._pipeline(conn, "load", commands, read)
        outcomes = [reply is True for reply in replies]
        bad: list[tuple[bytes, str]] = []
        gone: list[bytes] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, _Bad):
                bad.append((key, reply.sha1))
                self._book.count("bad_chunks")
                self._book.count(f"bad_{reply.reason.value}")
                self._faillog.failed(f"bad:{reply.reason.value}",
                             ValueError(f"removing bad value {self._rkey(key).decode()}"))
            elif isinstance(reply, ResponseError):
                self._faillog.failed(f"load:{str(reply).split(' ', 1)[0]}", reply)
            elif reply is None:
                gone.append(key)  # absent: never stored, expired or evicted by the server
        loaded = [k for k, ok in zip(keys, outcomes, strict=True) if ok]
        self._book.count("loaded", len(loaded))
        self._book.count("load_failures", len(batch) - len(loaded))
        self._book.count("load_misses", len(gone))
        if bad:
            self._delete_bad(conn, bad)
        lost = gone + [k for k, _ in bad]
        self._remember(loaded, LookupResult.HIT)
        self._remember(lost, LookupResult.MISS)
        self._book.events(TierEventKind.REMOVED, lost)
        return outcomes

    def _read_value(self, reader: ReplyReader, key: bytes, row: memoryview) -> Any:
        """Read one GET reply: the payload straight into `row`, then verify it. True when `row`
        holds the chunk; None when the key is absent; a ResponseError; or _Bad."""
        line = reader.line()
        if line in (b"$-1", b"_"):  # RESP2 / RESP3 null
            return None
        if line[:1] == b"-":
            return ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise RedisConnectionError(f"unexpected reply {line[:40]!r} to GET")
        size = int(line[1:])
        head = memoryview(bytearray(min(size, chunkfmt.HEADER_BYTES)))
        reader.read_into(head)
        sha1 = hashlib.sha1(head)
        if size == self.value_bytes:
            reader.read_into(row)
            reader.end_bulk()
            err, digest = chunkfmt.check_header(head, key, self._fp, len(row))
            if err is None and chunkfmt.checksum(row) != digest:
                err = chunkfmt.ChunkError.CHECKSUM
            if err is None:
                return True
            sha1.update(row)
        else:
            reader.drain(size - len(head), sha1.update)
            reader.end_bulk()
            err = chunkfmt.check_header(head, key, self._fp, len(row))[0] or chunkfmt.ChunkError.LENGTH
        return _Bad(err, sha1.hexdigest())

    def _delete_bad(self, conn: Any, bad: list[tuple[bytes, str]]) -> None:
        """Delete each bad value (key, SHA-1 hex of the value read) unless it changed since."""
        script = [("EVAL", _DELETE_IF_SAME, 1, self._rkey(k), sha1) for k, sha1 in bad]
        replies = self._pipeline(conn, "delete", script)
        fallback = [("DEL", self._rkey(k)) for (k, _), r in zip(bad, replies, strict=True)
                    if isinstance(r, ResponseError)]  # scripting disabled on this server
        if fallback:
            self._pipeline(conn, "delete", fallback)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _finish_key(self, tracker: JobTracker, i: int, ok: bool) -> None:
        if tracker.finish_key(i, ok):
            self._book.finish(tracker)

    def _mark_down(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.reconnect_interval_s
            self._answers.clear()  # what the server held before may be gone (restart)
            self._down_cause = f"{op}:{type(exc).__name__}"
        self._book.count("connection_errors")
        self._faillog.failed(self._down_cause, exc)

    def _mark_up(self) -> None:
        with self._lock:
            if not self._down_cause:
                return
            cause, self._down_cause = self._down_cause, ""
        self.ctx.log.info("redis tier %s: %s answers again (after %s)", self.ctx.tier_name,
                          self.url, cause)
