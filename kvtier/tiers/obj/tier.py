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

from kvtier.chunks import ChunkKey, TierEventKind
from kvtier.errors import ConfigError
from kvtier.tiers.base import LookupResult, TierContext, TierUsage
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.booked import PerKeyTier
from kvtier.tiers.common.iopool import IoPool
from kvtier.tiers.obj.client import (
    NOT_FOUND,
    ChunkIO,
    error_code,
    make_client,
    positive_option,
    probe,
    text_option,
)
from kvtier.tiers.obj.health import ServerHealth
from kvtier.tiers.obj.index import ObjIndex


class ObjTier(PerKeyTier):
    """Chunks as objects under `<prefix>/<layout fingerprint>/` in one S3 bucket."""

    medium = "STORAGE"
    locality = "REMOTE"
    COUNTERS = ("bad_chunks", "store_failures", "load_failures", "load_misses", "stored", "loaded",
                "evictions", "heads", "lookup_failures", "listings")
    _index: ObjIndex

    def __init__(
        self,
        ctx: TierContext,
        *,
        bucket: str,
        endpoint: str | None = None,
        prefix: str = "kvtier",
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        io_threads: int = 8,
        max_bytes: int | float | None = None,
        negative_ttl_s: float = 1.5,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 20.0,
        path_style: bool | None = None,
        create_bucket: bool = False,
    ) -> None:
        super().__init__(ctx)
        text_option("bucket", bucket, allow_none=False)
        text_option("endpoint", endpoint, allow_none=True)
        text_option("prefix", prefix, allow_none=True)
        text_option("region", region, allow_none=True)
        text_option("access_key_id", access_key_id, allow_none=True)
        text_option("secret_access_key", secret_access_key, allow_none=True)
        text_option("session_token", session_token, allow_none=True)
        if (access_key_id is None) != (secret_access_key is None):
            missing = "secret_access_key" if secret_access_key is None else "access_key_id"
            raise ConfigError(missing, None, "access_key_id and secret_access_key go together")
        positive_option("io_threads", io_threads, integer=True)
        if io_threads > 256:
            raise ConfigError("io_threads", io_threads, "must be an integer from 1 to 256")
        for name, value in (("negative_ttl_s", negative_ttl_s), ("connect_timeout_s",
                            connect_timeout_s), ("read_timeout_s", read_timeout_s)):
            positive_option(name, value, integer=False)
        for name, flag in (("path_style", path_style), ("create_bucket", create_bucket)):
            if flag is not None and not isinstance(flag, bool):
                raise ConfigError(name, flag, "must be true or false")
        object_bytes = chunkfmt.HEADER_BYTES + ctx.row_bytes
        positive_option("max_bytes", max_bytes, integer=False, allow_none=True)
        if max_bytes is not None and max_bytes < object_bytes:
            raise ConfigError("max_bytes", max_bytes, f"must hold at least one object "
                              f"({object_bytes} bytes)")

        clean = (prefix or "").strip("/")
        self.bucket = bucket
        self.layout_prefix = f"{clean}/{ctx.layout_fingerprint}/" if clean else \
            f"{ctx.layout_fingerprint}/"
        self.negative_ttl_s = float(negative_ttl_s)
        new_client = functools.partial(
            make_client, endpoint=endpoint, region=region, access_key_id=access_key_id,
            secret_access_key=secret_access_key, session_token=session_token,
            path_style=endpoint is not None if path_style is None else path_style,
        )
        probe_client = new_client(connect_timeout_s=connect_timeout_s,
                                   read_timeout_s=connect_timeout_s, pool_connections=1, attempts=1)
        probe(probe_client, endpoint=endpoint, bucket=bucket, layout_prefix=self.layout_prefix,
              create_bucket=create_bucket)
        probe_client.close()
        client = new_client(connect_timeout_s=connect_timeout_s,
                             read_timeout_s=read_timeout_s, pool_connections=io_threads + 1,
                             attempts=2)
        self._io = ChunkIO(client, bucket, self._fp, ctx.row_bytes)
        self._index = ObjIndex(object_bytes, None if max_bytes is None else int(max_bytes),
                               self.negative_ttl_s)
        self._health = ServerHealth(ctx.log, f"obj tier {ctx.tier_name}", bucket)
        n_read = max(1, io_threads // 2)
        self._pool = IoPool(n_read, io_threads - n_read, f"kvtier-obj-{ctx.tier_name}")
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
        self._book.count("stored")
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
            self._book.count("load_misses")
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
        self._book.count("loaded")
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
            self._book.count("lookup_failures")
        self._book.count("heads")
        self._index.answer(key, present)

    def _drop_bad(self, name: str, key: bytes, reason: chunkfmt.ChunkError) -> None:
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
            self._book.count("evictions")

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
        self._book.count("listings")
