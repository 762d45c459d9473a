"""The body of a tier process: `python -m kvtier.tiers.worker FD` with a JSON spec on stdin.

The process maps the host region, builds one secondary tier, then serves the parent over the
socket FD: requests come in as tuples, completions, lookup answers, events and the tier's counts
and usage go out. One dispatch thread calls the tier; the tier's own I/O threads signal
completions through a self-pipe, so finished jobs are sent without polling delay. The process
exits when the parent closes the socket or dies, or on a shutdown request.

Wire messages (tuples of plain values and kvtier's own `TierCounts`; this socket connects two
processes of the same instance):
  in:  ("lookup", req_id, [key, ...]) | ("store"|"load", job_id, [key, ...], [slot, ...])
       | ("stats",) | ("shutdown",)
  out: ("ready", loads_own_stores, {role: address}) | ("error", message[, key, value, allowed])
       | ("lookup", req_id, [int, ...])
       | ("done", [(job_id, success, [key, ...], bytes, seconds), ...])
       | ("events", [(kind, [key, ...]), ...])
       | ("stats", TierCounts, (bytes_used, chunks, capacity_bytes) | None)

A stats report goes out every STATS_INTERVAL_S, on request, and as soon as the tier counts a bad
chunk (the tier wakes the dispatch loop: `TierBook.bad`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from kvtier.errors import ConfigError
from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, SecondaryTier, TierContext
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


def _flush(conn: Connection, tier: SecondaryTier) -> None:
    done = tier.get_finished_jobs()
    if done:
        conn.send(
            ("done", [(r.job_id, r.success, list(r.successful_keys), r.bytes_moved, r.seconds)
                      for r in done])
        )
    events = tier.take_events()
    if events:
        conn.send(("events", [(e.kind.value, list(e.keys)) for e in events]))


def _report(conn: Connection, tier: SecondaryTier) -> None:
    usage = tier.usage()
    fill = None if usage is None else (usage.bytes_used, usage.chunks, usage.capacity_bytes)
    conn.send(("stats", tier.counts(), fill))


def _serve(conn: Connection, tier: SecondaryTier, wake: _Wakeup) -> None:
    last_report = 0.0
    reported_bad = 0.0
    parent = os.getppid()
    while True:
        ready = wait([conn, wake.r], timeout=STATS_INTERVAL_S)
        if wake.r in ready:
            wake.drain()
        if conn in ready:
            msg = conn.recv()
            op = msg[0]
            if op == "lookup":
                conn.send(("lookup", msg[1], [int(r) for r in tier.lookup(msg[2])]))
            elif op in ("store", "load"):
                job = Job(msg[1], JobKind(op), tuple(msg[2]), tuple(msg[3]))
                (tier.submit_store if op == "store" else tier.submit_load)(job)
            elif op == "stats":
                _flush(conn, tier)
                _report(conn, tier)
            elif op == "shutdown":
                return
        _flush(conn, tier)
        now = time.monotonic()
        bad = tier.counts().bad_chunks
        if now - last_report >= STATS_INTERVAL_S or bad != reported_bad:
            _report(conn, tier)
            last_report, reported_bad = now, bad
            if os.getppid() != parent:
                return


def main() -> None:
    """Entry point of the tier process (never call in the engine's own process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
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
        wake = _Wakeup()
        ctx = TierContext(
            region=region.buf,
            row_bytes=spec["row_bytes"],
            num_slots=spec["num_slots"],
            layout_fingerprint=spec["layout_fingerprint"],
            tier_name=spec["tier_name"],
            generations=None if gens_at is None else generations.view(region.buf, gens_at, spec["num_slots"]),
            wakeup=wake,
            log=logging.getLogger(f"kvtier.tier.{spec['tier_name']}"),
        )
        cls = resolve_tier(spec["config_key"], spec["type"], spec.get("module_path"))
        tier = cls(ctx, **spec["options"])
    except ConfigError as e:
        plain = isinstance(e.value, str | int | float | bool | None)
        conn.send(("error", str(e), e.key, e.value if plain else repr(e.value), e.allowed))
        sys.exit(1)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", cls.loads_own_stores, tier.endpoints()))
    try:
        _serve(conn, tier, wake)
    except (EOFError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            tier.shutdown()
            _flush(conn, tier)
        region.close()


if __name__ == "__main__":
    main()
