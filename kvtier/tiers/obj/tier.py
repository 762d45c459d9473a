"""The obj secondary tier: one object per chunk in an S3-compatible bucket, shared across machines.

An object is the `chunkfmt` header (4 KiB) followed by the host row, named
`<prefix>/<layout fingerprint>/<key hex>`. Every instance pointed at the same bucket and prefix
shares the chunks without configuration; a put is atomic in S3, so a reader sees no object or a
whole one. A load verifies the header fields and the checksum; a bad object is counted, deleted and
reported as a failed key.

Client: boto3 (see `obj_client`), chosen over obstore after measuring both against the same
SeaweedFS server at 2 MiB chunks with 8 requests in flight (BENCHMARKS.md): their
throughput was equal within the noise of three runs, the server being the bottleneck, and boto3 is
the dependency kvtier already declares, reads every standard AWS credential source (environment,
shared files, profiles, SSO, instance roles) and names S3 errors precisely for the start-up probe.

Threads: the dispatch thread calls the contract methods, which only enqueue work. An `IoPool` of
`io_threads` threads does one request per task: HEADs for lookups and GETs for loads come first
(half the threads prefer them), PUTs for stores on the others, and every thread takes the other
kind of work when its own queue is empty. `ObjIndex` holds what is known about keys.

Lookups are asynchronous: an unknown key is RETRY while a HEAD for it is in flight; a present key
stays HIT until a load finds it missing or bad, an absent one is MISS for `negative_ttl_s` from
the first time it is reported. A HEAD that fails for another reason (server down) answers MISS for
the same time, so lookups never hang.

Failures are values: a request that fails ends its key as failed; `ServerHealth` logs one line
per cause (operation and S3 error code or exception), not per chunk, and the first success after
failures once. After a connection-level failure no request is sent for a second, so a dead or hung
server fails a backlog of keys at once rather than one timeout each. The client reconnects by
itself: the tier recovers without a restart when the server comes back.
Credentials are never logged, kept in attributes or put in errors.

`max_bytes` bounds the bytes of the objects this instance knows of (stored, loaded or found under
its layout prefix at start); beyond it the least recently used known objects are deleted.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.format.chunks import ChunkError, ChunkKey, TierEventKind
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import LookupResult, TierContext, TierUsage
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.io_tier import PerKeyTier
from kvtier.tiers.common.iopool import IoPool
from kvtier.tiers.common.options import (
    Kind,
    Option,
    at_least,
    check_options,
    count,
    hidden,
    max_bytes_option,
    seconds,
)
from kvtier.tiers.obj.health import ServerHealth
from kvtier.tiers.obj.index import ObjIndex
from kvtier.tiers.obj.s3_client import NOT_FOUND, ChunkIO, connect, error_code


class ObjTier(PerKeyTier):
    """Chunks as objects under `<prefix>/<layout fingerprint>/` in one S3 bucket."""

    medium = "STORAGE"
    locality = "REMOTE"
    _index: ObjIndex
    OPTIONS = (
        Option("bucket", Kind.TEXT, required=True, test=bool, allowed="must be a non-empty string"),
        Option("endpoint", Kind.TEXT),
        Option("prefix", Kind.TEXT, "kvtier", nullable=True),
        Option("region", Kind.TEXT),
        Option("access_key_id", Kind.TEXT),
        Option("secret_access_key", Kind.TEXT, show=hidden),
        Option("session_token", Kind.TEXT, show=hidden),
        count("io_threads", 8, 256),
        max_bytes_option(),
        seconds("negative_ttl_s", 1.5),
        seconds("connect_timeout_s", 2.0),
        seconds("read_timeout_s", 20.0),
        Option("path_style", Kind.BOOL),
        Option("create_bucket", Kind.BOOL, False),
    )
    """`bucket`, `endpoint` (null: AWS), `prefix` of the object names, `region`; credentials
    (`access_key_id` with `secret_access_key`, `session_token`; null: the AWS chain); `io_threads`;
    `max_bytes` (null: unbounded; at least one object); `negative_ttl_s` (how long a miss is
    believed); the client's timeouts; `path_style` (null: with a custom endpoint) and
    `create_bucket`."""

    def __init__(self, ctx: TierContext, **options: Any) -> None:
        super().__init__(ctx)
        o = check_options(self.OPTIONS, options)
        if (o["access_key_id"] is None) != (o["secret_access_key"] is None):
            missing = "secret_access_key" if o["secret_access_key"] is None else "access_key_id"
            raise ConfigError(missing, None, "access_key_id and secret_access_key go together")
        object_bytes = chunkfmt.HEADER_BYTES + ctx.row_bytes
        max_bytes = o["max_bytes"]
        at_least("max_bytes", max_bytes, object_bytes, "one object")
        clean = (o["prefix"] or "").strip("/")
        self.bucket = o["bucket"]
        self.layout_prefix = f"{clean}/{ctx.layout_fingerprint}/" if clean else \
            f"{ctx.layout_fingerprint}/"
        self.negative_ttl_s = float(o["negative_ttl_s"])
        self._io = ChunkIO(connect(o, self.layout_prefix), self.bucket, self._fp, ctx.row_bytes,
                           ctx.fleet_key)
        self._index = ObjIndex(object_bytes, None if max_bytes is None else int(max_bytes),
                               self.negative_ttl_s)
        self._health = ServerHealth(ctx.log, f"obj tier {ctx.tier_name}", self.bucket)
        n_read = max(1, o["io_threads"] // 2)
        self._pool = IoPool(n_read, o["io_threads"] - n_read, f"kvtier-obj-{ctx.tier_name}")
        if max_bytes is not None:
            self._pool.submit(False, [self._scan])

    # ---- contract ----------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> list[LookupResult]:
        answers, ask = self._index.lookup(keys, time.monotonic())
        if ask:
            self._pool.submit(True, [functools.partial(self._head, key) for key in ask])
        return answers

    def usage(self) -> TierUsage:
        return TierUsage(self._index.bytes_used, self._index.present, self._index.max_bytes or 0)

    def _close(self) -> None:
        self._io.client.close()

    # ---- per-key I/O (I/O threads) -----------------------------------------------------------

    def _io_ready(self) -> bool:
        return not self._health.down()

    def _key_failed(self, cause: str, exc: BaseException) -> None:
        self._health.failed(cause, exc)

    def _error_name(self, exc: BaseException) -> str:
        return error_code(exc)

    def _name(self, key: bytes) -> str:
        return self.layout_prefix + key.hex()

    def _store_key(self, key: ChunkKey, slot: int) -> bool:
        row = self.ctx.slot_view(slot)
        if self._index.touch(key):
            return True  # present (content-named: the same key is the same bytes)
        granted, victims = self._index.reserve()
        self._delete(victims)
        if not granted:
            self._health.failed("store:max_bytes", ValueError("every known object is being loaded"))
            return False
        try:
            self._io.put(self._name(key), key, row)
        finally:
            self._index.release()
        self._health.succeeded()
        if self._index.add(key):
            self._book.event(TierEventKind.STORED, key)
        self._book.count(TierCounter.STORED)
        return True

    def _load_key(self, key: ChunkKey, slot: int) -> bool:
        from botocore.exceptions import ClientError

        name = self._name(key)
        self._index.pin(key)
        try:
            bad = self._io.get(name, key, self.ctx.slot_view(slot))
        except ClientError as e:
            if error_code(e) not in NOT_FOUND:
                raise
            self._health.succeeded()
            self._book.count(TierCounter.LOAD_MISSES)
            self._forget(key)
            return False
        finally:
            self._index.unpin(key)
        self._health.succeeded()
        if bad is not None:
            self._drop_bad(name, key, bad)
            return False
        if self._index.add(key):
            self._book.event(TierEventKind.STORED, key)
        self._book.count(TierCounter.LOADED)
        return True

    def _head(self, key: ChunkKey) -> None:
        """Answer one pending lookup; a failed HEAD is a brief MISS (never a hang)."""
        present: bool | None = None
        try:
            if not self._health.down():
                present = self._io.exists(self._name(key))
                self._health.succeeded()
        except Exception as e:
            self._health.failed(f"lookup:{error_code(e)}", e)
            self._book.count(TierCounter.LOOKUP_FAILURES)
        self._book.count(TierCounter.HEADS)
        self._index.answer(key, present)

    def _drop_bad(self, name: str, key: bytes, reason: ChunkError) -> None:
        self._bad(reason, f"deleted bad object {name}")
        try:
            self._io.delete(name)
        except Exception as e:
            self._health.failed(f"delete:{error_code(e)}", e)
        self._forget(key)

    def _delete(self, victims: list[bytes]) -> None:
        for key in victims:
            try:
                self._io.delete(self._name(key))
            except Exception as e:
                self._health.failed(f"evict:{error_code(e)}", e)
            self._book.event(TierEventKind.REMOVED, key)
            self._book.count(TierCounter.EVICTIONS)

    def _scan(self) -> None:
        """Learn the objects already under the layout prefix (for `max_bytes`); a pool task."""
        self._index.start_scan()
        try:
            listed = self._io.list_names(self.layout_prefix)
        except Exception as e:
            self._health.failed(f"list:{error_code(e)}", e)
            self._index.merge_listed([])
            return
        found: list[tuple[bytes, float]] = []
        for name, size, mtime in listed:
            hex_key = name[len(self.layout_prefix):]
            if size == self._io.object_bytes and len(hex_key) == 64:
                with contextlib.suppress(ValueError):
                    found.append((bytes.fromhex(hex_key), mtime))
        found.sort(key=lambda item: item[1])
        self._index.merge_listed([k for k, _ in found])
        self._delete(self._index.reserve(0)[1])
        self._book.count(TierCounter.LISTINGS)
