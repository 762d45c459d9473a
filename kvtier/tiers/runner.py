"""The tier runner, the body of a tier process: `python -m kvtier.tiers.runner FD` with a JSON spec
on stdin.

The process maps the host region, builds one secondary tier, then serves the engine over the socket
FD in the typed frames of `kvtier.tiers.messages` (nothing is pickled): `LookupRequest`,
`JobRequest`, `StatsRequest` and `Shutdown` come in; `Ready` (or `ErrorReport`) goes out once, then
`LookupReply`, `JobsDone`, `EventsReport` and `StatsReport`. One dispatch thread calls the tier and
writes the socket; the tier's own I/O threads signal completions through a self-pipe, so finished
jobs are sent without polling delay. The process exits when the engine closes the socket or dies,
on `Shutdown`, or after answering a malformed frame with an `ErrorReport`.

A stats report goes out every STATS_INTERVAL_S, on request, and as soon as the tier counts a bad
chunk (the tier wakes the dispatch loop: `TierBook.bad`).

Every job's `seconds` is stamped here, from reading its request to sending its result, whatever
the tier itself reports: the time the job took in this process, queueing in the tier included and
the engine's wait for its next poll excluded (the load choice prices a tier's loads with it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from kvtier.errors import ConfigError
from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.tiers.base import JobKind, SecondaryTier, TierContext
from kvtier.tiers.codec import MessageError
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.messages import (
    ErrorReport,
    EventsReport,
    JobRequest,
    JobsDone,
    LookupReply,
    LookupRequest,
    Ready,
    Shutdown,
    StatsReport,
    StatsRequest,
    read_message,
    send_message,
)
from kvtier.tiers.registry import resolve_tier

STATS_INTERVAL_S = 0.5
log = logging.getLogger("kvtier.tier")


class _Wakeup:
    """A self-pipe: tier threads write a byte, the dispatch loop wakes on the read end."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)

    def __call__(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self.w, b"x")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.r, 4096):
                pass


def _flush(sock: socket.socket, tier: SecondaryTier, read_at: dict[int, float]) -> None:
    """Send the finished jobs and the events, the events first: every event a job raised (a bad
    chunk's REMOVED, a store's STORED) reaches the engine no later than the job's result. Each
    result's seconds run from `read_at[job_id]` (when its request was read) to now."""
    now = time.monotonic()
    finished = tuple(replace(r, seconds=now - read_at.pop(r.job_id, now - r.seconds))
                     for r in tier.get_finished_jobs())
    for events in EventsReport(tuple(tier.take_events())).parts():
        send_message(sock, events)
    for done in JobsDone(finished).parts():
        send_message(sock, done)


def _report(sock: socket.socket, tier: SecondaryTier) -> None:
    send_message(sock, StatsReport(tier.counts(), tier.usage()))


def _answer(sock: socket.socket, tier: SecondaryTier, read_at: dict[int, float]) -> bool:
    """Read one message off `sock` and act on it (a job's read time goes to `read_at`); False
    once the runner should stop."""
    try:
        msg = read_message(sock)
    except MessageError as e:
        log.error("malformed message from the engine: %s", e)
        send_message(sock, ErrorReport(f"malformed message from the engine: {e}"))
        return False
    if isinstance(msg, LookupRequest):
        send_message(sock, LookupReply(msg.req_id, tuple(tier.lookup(msg.keys))))
    elif isinstance(msg, JobRequest):
        read_at[msg.job.job_id] = time.monotonic()
        (tier.submit_store if msg.job.kind is JobKind.STORE else tier.submit_load)(msg.job)
    elif isinstance(msg, StatsRequest):
        _flush(sock, tier, read_at)
        _report(sock, tier)
    elif isinstance(msg, Shutdown):
        return False
    else:
        send_message(sock, ErrorReport(f"the engine sent a tier's message: {type(msg).__name__}"))
        return False
    return True


def _serve(sock: socket.socket, tier: SecondaryTier, wake: _Wakeup, read_at: dict[int, float]) -> None:
    last_report = 0.0
    reported_bad = 0.0
    parent = os.getppid()
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        sel.register(wake.r, selectors.EVENT_READ)
        while True:
            ready = {key.fd for key, _ in sel.select(timeout=STATS_INTERVAL_S)}
            if wake.r in ready:
                wake.drain()
            if sock.fileno() in ready and not _answer(sock, tier, read_at):
                return
            _flush(sock, tier, read_at)
            now = time.monotonic()
            bad = tier.counts().bad_chunks
            if now - last_report >= STATS_INTERVAL_S or bad != reported_bad:
                _report(sock, tier)
                last_report, reported_bad = now, bad
                if os.getppid() != parent:
                    return


def main() -> None:
    """Entry point of the tier process (never call in the engine's own process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    spec: dict[str, Any] = json.load(sys.stdin)
    logging.basicConfig(
        level=spec.get("log_level", logging.INFO),
        format=f"%(asctime)s kvtier[{spec['tier_name']}] %(levelname)s %(message)s",
    )
    # Client libraries print request headers (an S3 access key id) at DEBUG: never below INFO here.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
    region = None
    try:
        region = HostRegion.attach(spec["region_name"], shm_dir=spec["shm_dir"])
        gens_at = spec.get("generations_offset")
        key_file = spec.get("fleet_key_file")
        wake = _Wakeup()
        ctx = TierContext(
            region=region.buf,
            row_bytes=spec["row_bytes"],
            num_slots=spec["num_slots"],
            layout_fingerprint=spec["layout_fingerprint"],
            tier_name=spec["tier_name"],
            generations=None if gens_at is None else generations.view(region.buf, gens_at, spec["num_slots"]),
            fleet_key=None if key_file is None else FleetKey.from_file(key_file),
            wakeup=wake,
            log=logging.getLogger(f"kvtier.tier.{spec['tier_name']}"),
        )
        cls = resolve_tier(spec["config_key"], spec["type"], spec.get("module_path"))
        tier = cls(ctx, **spec["options"])
    except ConfigError as e:
        value = e.value if isinstance(e.value, str | int | float | bool | None) else repr(e.value)
        send_message(sock, ErrorReport(str(e), e.key, value, e.allowed))
        sys.exit(1)
    except Exception as e:
        send_message(sock, ErrorReport(f"{type(e).__name__}: {e}"))
        sys.exit(1)
    send_message(sock, Ready(cls.loads_own_stores, tier.endpoints()))
    read_at: dict[int, float] = {}
    try:
        _serve(sock, tier, wake, read_at)
    except (EOFError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            tier.shutdown()
            _flush(sock, tier, read_at)
        region.close()


if __name__ == "__main__":
    main()
