"""Chunks as Redis strings: batches of SETs and GETs over a `Link`, each value verified on load.

A chunk is stored as the `chunkfmt` bytes (4 KiB header + host row) under
`<key_prefix>:<layout fingerprint>:<chunk key hex>`, optionally with a TTL (`px`; a load uses GETEX
to refresh it, so expiry follows last use). A store sends the header and the host row as separate
buffers of one hand-framed SET (the row is never copied in Python); a load reads the GET reply's
payload from the socket straight into the slot (`redis_wire.ReplyReader`), then checks the header
and checksum (the fleet key's MAC, with `ctx.fleet_key`) before reporting the key loaded. A value
that vanished is a miss; one that fails verification is counted and removed, unless another
instance replaced it meanwhile.

Threads: the I/O threads, each with its own connection; outcomes go to the tier's book and, through
`remember`, to its lookup answers. `held` (any thread) counts the chunks this instance stored or
loaded and has not seen vanish since (nor outlive their TTL): what the tier reports as its usage.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvtier.format.chunks import ChunkError, TierEventKind
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import JobKind, LookupResult, TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import TierBook
from kvtier.tiers.common.iopool import JobTracker
from kvtier.tiers.redis.link import Link
from kvtier.tiers.redis.wire import ReplyReader, set_command

_DELETE_IF_SAME = (
    "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then "
    "return redis.call('DEL', KEYS[1]) end return 0"
)
"""Delete a bad value only if it is still the one that was read (another instance may have
replaced it with a good copy meanwhile)."""

Item = tuple[JobTracker, int]
"""One key of a job: the job's tracker and the key's index in it."""
Remember = Callable[[Sequence[bytes], LookupResult], None]


@dataclass(frozen=True)
class Sent:
    """A round of one batch sent and not read yet: its keys and slots' rows, and the link's round."""

    batch: list[Item]
    load: bool
    keys: list[bytes]
    rows: list[memoryview]
    pending: Any


@dataclass(frozen=True)
class _Bad:
    """A load reply that is not a valid chunk of its key: why, and the SHA-1 of what was read."""

    reason: ChunkError
    sha1: str


class ChunkStore:
    """Stores and loads batches of chunks, one pipeline per batch."""

    def __init__(self, ctx: TierContext, link: Link, book: TierBook, layout_fp: bytes,
                 key_prefix: str, px: bytes | None, remember: Remember) -> None:
        self.ctx = ctx
        self._link = link
        self._book = book
        self._fp = layout_fp
        self._fleet = ctx.fleet_key
        self._key_head = f"{key_prefix}:{ctx.layout_fingerprint}:".encode()
        self._px = px
        self._remember = remember
        self.value_bytes = chunkfmt.HEADER_BYTES + ctx.row_bytes
        self._ttl_s = None if px is None else int(px) / 1000
        self._held: OrderedDict[bytes, float] = OrderedDict()
        """Chunk keys known stored, by last use (monotonic seconds), least recent first."""
        self._held_lock = threading.Lock()

    def held(self) -> int:
        """How many chunks this instance stored or loaded and has not seen vanish or expire since."""
        now = time.monotonic()
        with self._held_lock:
            while self._held and self._ttl_s is not None:
                key, last_use = next(iter(self._held.items()))
                if now - last_use < self._ttl_s:
                    break
                del self._held[key]
            return len(self._held)

    def _hold(self, keys: Sequence[bytes], lost: Sequence[bytes] = ()) -> None:
        now = time.monotonic()
        with self._held_lock:
            for key in keys:
                self._held[key] = now
                self._held.move_to_end(key)
            for key in lost:
                self._held.pop(key, None)

    def rkey(self, key: bytes) -> bytes:
        """The Redis key of a chunk key."""
        return self._key_head + key.hex().encode()

    def start(self, conn: Any, batch: list[Item]) -> Sent:
        """Send a batch of keys, all stores or all loads, in one round (`finish` reads its replies;
        the thread may send another round first)."""
        keys = [tracker.job.keys[i] for tracker, i in batch]
        rows = [self.ctx.slot_view(tracker.job.slots[i]) for tracker, i in batch]
        rkeys = [self.rkey(k) for k in keys]
        load = batch[0][0].job.kind is JobKind.LOAD
        if load:
            verb = "GET" if self._px is None else "GETEX"
            extra = () if self._px is None else ("PX", self._px)
            commands: list[Any] = [(verb, rkey, *extra) for rkey in rkeys]
        else:
            commands = [
                set_command(rkey, chunkfmt.header_bytes(key, self._fp, row, self._fleet), row, self._px)
                for key, rkey, row in zip(keys, rkeys, rows, strict=True)]
        pending = self._link.start(conn, "load" if load else "store", rkeys, commands)
        return Sent(batch, load, keys, rows, pending)

    def finish(self, sent: Sent) -> list[bool]:
        """Whether each key of a round `start` sent was stored, or loaded into its slot."""
        if not sent.load:
            return self._stored(sent, self._link.finish(sent.pending))
        keys, rows = sent.keys, sent.rows

        def read(reader: ReplyReader, n: int) -> Any:
            return self._read_value(reader, keys[n], rows[n])

        return self._loaded(sent, self._link.finish(sent.pending, read))

    def _stored(self, sent: Sent, replies: list[Any]) -> list[bool]:
        outcomes = [reply == b"OK" for reply in replies]
        for reply in replies:
            if isinstance(reply, ResponseError):  # e.g. OOM: maxmemory with the noeviction policy
                self._link.faillog.failed(f"store:{str(reply).split(' ', 1)[0]}", reply)
        stored = [key for key, ok in zip(sent.keys, outcomes, strict=True) if ok]
        self._remember(stored, LookupResult.HIT)
        self._hold(stored)
        self._book.count(TierCounter.STORED, len(stored))
        self._book.count(TierCounter.STORE_FAILURES, len(sent.keys) - len(stored))
        self._book.events(TierEventKind.STORED, stored)
        return outcomes

    def _loaded(self, sent: Sent, replies: list[Any]) -> list[bool]:
        keys = sent.keys
        outcomes = [reply is True for reply in replies]
        bad: list[tuple[bytes, str]] = []
        gone: list[bytes] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, _Bad):
                bad.append((key, reply.sha1))
                self._book.bad(reply.reason)
                self._link.faillog.failed(f"bad:{reply.reason.value}",
                                          ValueError(f"removing bad value {self.rkey(key).decode()}"))
            elif isinstance(reply, ResponseError):
                self._link.faillog.failed(f"load:{str(reply).split(' ', 1)[0]}", reply)
            elif reply is None:
                gone.append(key)  # absent: never stored, expired or evicted by the server
        loaded = [k for k, ok in zip(keys, outcomes, strict=True) if ok]
        self._book.count(TierCounter.LOADED, len(loaded))
        self._book.count(TierCounter.LOAD_FAILURES, len(keys) - len(loaded))
        self._book.count(TierCounter.LOAD_MISSES, len(gone))
        if bad:
            self.delete_bad(bad)
        lost = gone + [k for k, _ in bad]
        self._remember(loaded, LookupResult.HIT)
        self._remember(lost, LookupResult.MISS)
        self._hold(loaded, lost)
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
            err, digest = chunkfmt.check_header(head, key, self._fp, len(row), self._fleet)
            if err is None:
                err = chunkfmt.check_payload(head, row, digest, self._fleet)
            if err is None:
                return True
            sha1.update(row)
        else:
            reader.drain(size - len(head), sha1.update)
            reader.end_bulk()
            err = chunkfmt.check_header(head, key, self._fp, len(row), self._fleet)[0] or ChunkError.LENGTH
        return _Bad(err, sha1.hexdigest())

    def delete_bad(self, bad: list[tuple[bytes, str]]) -> None:
        """Delete each bad value (key, SHA-1 hex of the value read) unless it changed since, over a
        connection of its own (the thread's may carry a round not read yet)."""
        rkeys = [self.rkey(k) for k, _ in bad]
        script = [("EVAL", _DELETE_IF_SAME, 1, self.rkey(k), sha1) for k, sha1 in bad]
        conn = self._link.connection()
        try:
            replies = self._link.pipeline(conn, "delete", rkeys, script)
            fallback = [rkey for rkey, r in zip(rkeys, replies, strict=True)
                        if isinstance(r, ResponseError)]  # scripting disabled on this server
            if fallback:
                self._link.pipeline(conn, "delete", fallback, [("DEL", rkey) for rkey in fallback])
        finally:
            conn.disconnect()
