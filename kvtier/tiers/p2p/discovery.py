"""Peer discovery through a redis server: each instance registers its address, and reads the others.

Every instance writes `<prefix>:<layout fingerprint>:<its address>` = address with a TTL of
`ttl_s` and refreshes it every `ttl_s / 3` from one discovery thread, which also lists the keys
under the prefix (SCAN) and hands static peers + discovered ones to `on_peers`. An instance that
dies disappears within `ttl_s`; one that shuts down deletes its key. Only instances with the same
layout see each other. A redis failure is logged once per cause and the last known peers are kept.
Registration grants nothing: a listed address is still a peer only if it proves the shared secret.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.p2p.protocol import PeerFailure


class Discovery:
    def __init__(
        self, url: str, prefix: str, layout_fingerprint: str, address: str, ttl_s: float,
        static_peers: list[str], on_peers: Callable[[list[str]], None], book: TierBook, failures: FailureLog,
    ) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError("discovery_url", url, "needs the redis package (kvtier[redis])") from None
        try:
            self._redis: Any = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        except ValueError as e:
            raise ConfigError("discovery_url", "(redacted)", f"not a usable redis URL: {e}") from None
        self._pattern = f"{prefix}:{layout_fingerprint}:*"
        self._key = f"{prefix}:{layout_fingerprint}:{address}"
        self._address = address
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._interval_s = ttl_s / 3
        self._static = static_peers
        self._on_peers = on_peers
        self._book = book
        self._failures = failures
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="kvtier-p2p-discovery", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Register our address again and publish the current peer list (never raises)."""
        try:
            self._redis.set(self._key, self._address, px=self._ttl_ms)
            found = [v.decode() for k in self._redis.scan_iter(match=self._pattern, count=1000)
                     if (v := self._redis.get(k)) is not None]
        except Exception as e:  # redis errors and I/O errors alike: keep the last known peers
            why = PeerFailure(f"redis discovery failed: {e}")
            self._failures.failed(f"discovery:{type(e).__name__}", why)
            return
        self._book.count(TierCounter.DISCOVERY_REFRESHES)
        self._on_peers([*self._static, *(a for a in sorted(found) if a != self._address)])

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.refresh()

    def close(self) -> None:
        """Stop refreshing and deregister (best effort). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            self._redis.delete(self._key)
        except Exception as e:
            why = PeerFailure(f"could not deregister: {e}")
            self._failures.failed(f"discovery:{type(e).__name__}", why)
        self._redis.close()
