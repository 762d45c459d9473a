"""`kvtier trace record --zmq ENDPOINT --out FILE`: a kvtier trace from vLLM's own KV events.

For an engine running without kvtier (a GPU-only baseline), started with
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'`.
The recorder subscribes to the engine's ZMQ publisher (it connects to ENDPOINT; with `--bind` it
binds there instead, for a publisher given a non-wildcard endpoint, which then connects) and
writes, for each of the engine's own `BlockStored` events (device medium, not a connector's), one
stored-batch record `{"t": batch time, "keys": block hashes}`, and for each `BlockRemoved` one
removal record (`kvtier.trace.records`). Block hashes are cut to the trace's 8-byte keys (an
integer hash is taken modulo 2^64). vLLM stores a block only when it computes it: a block served
by the device prefix cache emits nothing, so a reuse in this trace is a block computed again after
the device evicted it, the reuse a host tier would have served.

Recording stops at `--duration` seconds, after `--max-events` events, or on SIGINT/SIGTERM; the
trace is flushed either way. Batches lost by the publisher (sequence gaps), messages that are not
vLLM's three frames (topic, 8-byte sequence number, payload) and payloads that are not KV event
batches are counted, dropped and printed at the end; nothing a publisher sends ends the recording.
A message over `--max-message-bytes` (ZMQ's MAXMSGSIZE) makes ZMQ drop its sender's connection
before buffering it (the publisher reconnects).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.trace.records import TraceHeader
from kvtier.trace.writer import TraceWriter

KEY_MASK = (1 << 64) - 1
OWN_MEDIA = (None, "GPU")
MAX_MESSAGE_BYTES = 64 << 20
"""The default bound on one message from the publisher (ZMQ's MAXMSGSIZE)."""
SEQ_BYTES = 8


def _key(block_hash: bytes | int) -> bytes:
    if isinstance(block_hash, bytes):
        return block_hash[:8].rjust(8, b"\0")
    return (block_hash & KEY_MASK).to_bytes(8, "big")


class Recorder:
    """Turns decoded KV event batches into trace records (one writer, opened at the first
    `BlockStored`, which says the block size)."""

    def __init__(self, out: Path, bytes_per_token: int | None, max_bytes: int) -> None:
        self.out = out
        self.bytes_per_token = bytes_per_token
        self.max_bytes = max_bytes
        self.writer: TraceWriter | None = None
        self.events = 0
        self.missed = 0
        self.malformed = 0
        """Messages not made of a topic, an 8-byte sequence number and a payload."""
        self.undecodable = 0
        self._pending_removals: list[dict[str, Any]] = []

    def batch(self, ts: float, events: list[Any]) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        for event in events:
            own = getattr(event, "medium", None) in OWN_MEDIA and not getattr(event, "ownership", None)
            if not own or not isinstance(event, BlockStored | BlockRemoved):
                continue  # a connector's copy, or AllBlocksCleared (its blocks are not named)
            self.events += 1
            keys = b"".join(_key(h) for h in event.block_hashes).hex()
            if isinstance(event, BlockStored):
                self._write(event.block_size, {"t": ts, "keys": keys})
            else:
                self._write(None, {"t": ts, "removed": keys})

    def _write(self, block_size: int | None, record: dict[str, Any]) -> None:
        if self.writer is None and block_size is None:
            self._pending_removals.append(record)  # before the first store: its block size is unknown
            return
        if self.writer is None and block_size is not None:
            chunk_bytes = self.bytes_per_token * block_size if self.bytes_per_token else None
            header = TraceHeader("kv_events", block_size, 1, chunk_bytes)
            self.writer = TraceWriter(self.out, header, self.max_bytes, queue_records=1 << 20)
            for pending in self._pending_removals:
                self.writer.write(pending)
        if self.writer is not None:
            self.writer.write(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(timeout=30.0)


def record(endpoint: str, out: Path, *, bind: bool = False, topic: str = "",
           duration_s: float | None = None, max_events: int | None = None,
           bytes_per_token: int | None = None, max_bytes: int = 1 << 30,
           max_message_bytes: int = MAX_MESSAGE_BYTES,
           stop: threading.Event | None = None, ready: threading.Event | None = None) -> Recorder:
    """Record until the duration or event count is reached or `stop` is set; `ready` is set once
    the socket is subscribed. Returns the recorder (its counts); the trace is closed."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    stop = stop or threading.Event()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    (sock.bind if bind else sock.connect)(endpoint)
    if ready is not None:
        ready.set()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    recorder = Recorder(out, bytes_per_token, max_bytes)
    deadline = None if duration_s is None else time.monotonic() + duration_s
    last_seq: int | None = None
    try:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            if max_events is not None and recorder.events >= max_events:
                break
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                recorder.malformed += 1
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq is not None and seq > last_seq + 1:
                recorder.missed += seq - last_seq - 1
            last_seq = seq
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError:
                recorder.undecodable += 1
                continue
            recorder.batch(batch.ts, batch.events)
    finally:
        sock.close(linger=0)
        ctx.term()
        recorder.close()
    return recorder


def add_parser(sub: Any) -> None:
    p = sub.add_parser("trace", help="record kvtier traces")
    trace_sub = p.add_subparsers(dest="trace_command", required=True)
    r = trace_sub.add_parser("record", help="record a trace from vLLM's KV events (ZMQ)",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--zmq", required=True, metavar="ENDPOINT", help="the engine's KV-events endpoint")
    r.add_argument("--out", required=True, type=Path, help="the trace file to write")
    r.add_argument("--bind", action="store_true", help="bind ENDPOINT (the publisher connects)")
    r.add_argument("--topic", default="", help="the publisher's topic")
    r.add_argument("--duration", type=float, help="stop after this many seconds")
    r.add_argument("--max-events", type=int, help="stop after this many events")
    r.add_argument("--bytes-per-token", type=int,
                   help="KV bytes per token, written in the header for `kvtier plan`")
    r.add_argument("--max-bytes", type=int, default=1 << 30, help="rotate the trace at this size")
    r.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
                   help="the largest message taken from the publisher (a larger one drops its "
                        "connection)")
    r.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    print(f"kvtier trace: recording {args.zmq} into {args.out}", file=sys.stderr, flush=True)
    try:
        rec = record(args.zmq, args.out, bind=args.bind, topic=args.topic, duration_s=args.duration,
                     max_events=args.max_events, bytes_per_token=args.bytes_per_token,
                     max_bytes=args.max_bytes, max_message_bytes=args.max_message_bytes, stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"kvtier trace: recorded {rec.events} events into {args.out}; {rec.missed} batches missed, "
          f"{rec.undecodable} undecodable, {rec.malformed} malformed", file=sys.stderr)
    return 0
