"""The background trace writer: records go to a bounded queue, one thread writes them as JSON lines.

`write` never blocks its caller (the engine's scheduler thread): when the queue is full the record
is dropped and counted in `dropped`. The writer thread opens the file itself (so a slow or stalled
file system stalls only it), writes the header first, and appends records one per line. A file
that already holds this engine's header and ends with a whole line is appended to; any other file
at the path is moved to `PATH.1` first. When the file reaches `max_bytes` it is moved to `PATH.1`
(replacing the previous one) and a new file with the header starts, so the trace holds at most
about twice `max_bytes` on disk. Any write error (a full disk) stops tracing for good with one
warning; serving is never affected. `close` writes what is queued and stops the thread; idempotent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import IO, Any

from kvtier.trace.records import TraceHeader

log = logging.getLogger("kvtier.trace")

QUEUE_RECORDS = 10_000
_STOP = object()


class TraceWriter:
    """Appends records to a rotating trace file from a background thread."""

    def __init__(self, path: str | Path, header: TraceHeader, max_bytes: int,
                 queue_records: int = QUEUE_RECORDS) -> None:
        self.path = Path(path)
        self.header_line = header.to_json() + "\n"
        self.max_bytes = max_bytes
        self.dropped = 0
        self.written = 0
        self.failed = False
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_records)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-trace", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> bool:
        """Queue one record; False (and counted in `dropped`) when the queue is full or tracing
        stopped. Never blocks."""
        if self.failed or self._closed:
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (waiting at most `timeout` seconds) and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        f: IO[str] | None = None
        try:
            f = self._open()
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                f.write(json.dumps(item, separators=(",", ":")) + "\n")
                self.written += 1
                if self._queue.empty():
                    f.flush()
                if self.path.is_file() and f.tell() >= self.max_bytes:
                    f.close()
                    os.replace(self.path, f"{self.path}.1")
                    f = self._open()
            f.flush()
        except OSError as e:
            self.failed = True
            log.warning("kvtier trace: writing %s failed (%s): tracing stopped, serving goes on",
                        self.path, e.strerror or e)
        finally:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def _open(self) -> IO[str]:
        """The trace file, open for appending, its header written (or already there)."""
        path = self.path
        if path.is_file() and path.stat().st_size > 0 and not self._resumable():
            os.replace(path, f"{path}.1")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with contextlib.suppress(PermissionError):  # a file another user made and lets us write
            os.fchmod(fd, 0o600)  # prompts' chunk keys: the serving user's alone, whatever the umask
        f = os.fdopen(fd, "a", encoding="utf-8")
        if not path.is_file() or f.tell() == 0:
            f.write(self.header_line)
            f.flush()
        return f

    def _resumable(self) -> bool:
        """The file holds this engine's header and ends with a whole line."""
        with open(self.path, "rb") as f:
            first = f.readline()
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
        return first.decode("utf-8", "replace") == self.header_line and last == b"\n"
