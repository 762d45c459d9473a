"""Whether the obj tier's server answers, and its failure log: one line per cause, not per chunk.

Thread-safe (one lock); called from the I/O threads. A cause is an operation and an S3 error code
or exception name ("load:EndpointConnectionError"). It is logged at its first occurrence, then at
most once per `book.LOG_INTERVAL_S` with the count of occurrences since; the first success after failures
is logged once, and clears the log so that the next outage is reported at once. A connection-level
failure marks the server down for DOWN_S, during which callers send no request.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.tiers.common.book import FailureLog
from kvtier.tiers.obj.s3_client import is_connection_error

DOWN_S = 1.0
"""After a connection-level failure (refused, timed out, closed), requests are not sent for this
long: queued keys fail at once and lookups answer MISS, instead of each waiting for a timeout."""


class ServerHealth:
    def __init__(self, log: logging.Logger, who: str, bucket: str) -> None:
        self.log = log
        self.who = who
        self.bucket = bucket
        self._log = FailureLog(log, who)
        self._failing = False
        self._down_until = 0.0
        self._lock = threading.Lock()

    def down(self) -> bool:
        """Whether a connection-level failure happened less than DOWN_S ago."""
        return time.monotonic() < self._down_until

    def succeeded(self) -> None:
        """A request got an answer from the server."""
        if not self._failing:
            return
        with self._lock:
            was, self._failing = self._failing, False
        self._log.clear()
        if was:
            self.log.info("%s: bucket %s answers again", self.who, self.bucket)

    def failed(self, cause: str, exc: BaseException) -> None:
        """Record a failure and log it (once per cause, see FailureLog). Causes starting with
        "bad:" are about stored data, not the server."""
        with self._lock:
            if is_connection_error(exc):
                self._down_until = time.monotonic() + DOWN_S
            if not cause.startswith("bad:"):
                self._failing = True
        self._log.failed(cause, exc)
