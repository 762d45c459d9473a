"""Pinning the host region off the engine thread.

Registering a mapping as page-locked memory takes time in proportion to its size (the driver locks
every page): hundreds of GiB take tens of seconds, longer than vLLM lets one step take. So
`RegionPin` registers the region on a thread of its own, started when the region is attached, and
logs the time it took per GiB. Until it ends, device copies use the region as pageable memory:
correct, but each `non_blocking` copy waits on the engine thread for its bytes (said once, in the
log, when pinning starts). When pinning fails the region stays pageable for good (a warning says
so and why).

`wait` ends the pinning before the region is unmapped: `close` never unpins a range still being
registered.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.host.region import HostPinner, HostRegion

log = logging.getLogger("kvtier.transfer")

GIB = 1 << 30


class RegionPin:
    """Pins `region` with `pinner` on a thread started at construction."""

    def __init__(self, region: HostRegion, pinner: HostPinner) -> None:
        self.region = region
        self.pinner = pinner
        self.seconds: float | None = None
        """How long registration took, once it succeeded."""
        self.error: Exception | None = None
        log.info(
            "kvtier pinning host region %s (%.1f GiB) in the background; until it is pinned, device "
            "copies to and from it wait on the engine thread", region.name, region.size / GIB,
        )
        self._thread = threading.Thread(target=self._pin, name=f"kvtier-pin-{region.name}", daemon=True)
        self._thread.start()

    def _pin(self) -> None:
        start = time.perf_counter()
        try:
            self.region.pin(self.pinner)
        except Exception as exc:
            self.error = exc
            log.warning(
                "kvtier could not pin host region %s (%d bytes): %s; device copies to and from it "
                "stay correct but each waits on the engine thread", self.region.name, self.region.size, exc,
            )
            return
        self.seconds = time.perf_counter() - start
        log.info(
            "kvtier pinned host region %s: %.1f GiB in %.2f s (%.2f s per GiB)", self.region.name,
            self.region.size / GIB, self.seconds, self.seconds / max(self.region.size / GIB, 1e-9),
        )

    @property
    def done(self) -> bool:
        """Whether pinning ended, pinned or not."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning ended (up to `timeout` seconds); whether it did."""
        self._thread.join(timeout)
        return self.done
