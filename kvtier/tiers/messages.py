"""The messages between the engine and a tier process: typed, versioned frames, never pickled.

A frame is a 12-byte header, then the payload:

    magic b"KVTM" | format version (u16) | message type (u16) | payload length (u32), network order

One frozen dataclass per message type; its `write` and `read` give the payload's fields, in one
order, in the encodings of `kvtier.tiers.codec` (a change to either is a new `VERSION`). The
engine sends `LookupRequest`, `JobRequest`, `StatsRequest` and `Shutdown`; the tier process sends
`Ready` (or `ErrorReport`) once, then `LookupReply`, `JobsDone`, `EventsReport`, `StatsReport` and,
when it cannot go on, `ErrorReport`.

`decode` (a whole frame) and `read_message` (a frame off a socket) validate everything: magic,
version, type, a declared length within `MAX_PAYLOAD` and equal to what follows, every field in
range, no byte left over. Whatever is wrong raises `MessageError` and nothing else; the reader of a
tier process's socket takes it as that process failing (`TierProcess`). `encode` raises
`MessageError` for a message it cannot represent (a key over 65,535 bytes, a negative id, a
payload over the cap). Nothing here keeps state; any thread may call it.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from kvtier.format.chunks import ChunkError, ChunkKey, TierEvent, TierEventKind
from kvtier.ops.metrics import TierCounter, TierCounts, TierGauge, TierStat
from kvtier.tiers.base import Job, JobKind, JobResult, LookupResult, TierUsage
from kvtier.tiers.codec import F64, U8, U32, U64, FieldReader, FieldWriter, MessageError, Scalar

MAGIC = b"KVTM"
VERSION = 1
HEADER = struct.Struct("!4sHHI")
MAX_PAYLOAD = 64 << 20
"""The largest payload a reader accepts (64 MiB: about 1.9 million keys): a declared length above
it is refused before anything is allocated."""
MAX_KEYS_PER_EVENT = 1 << 16
"""`EventsReport.parts` splits an event into events of at most this many keys."""
MAX_RESULTS_PER_FRAME = 1 << 10
"""`JobsDone.parts` splits a batch of results into frames of at most this many."""
_STAT_FAMILIES: tuple[type[TierStat], ...] = (TierCounter, ChunkError, TierGauge)
_LOOKUP_RESULTS = tuple(sorted(LookupResult))
"""Lookup answers by value (0, 1, 2: one byte each on the wire)."""
_RESULT = struct.Struct("!QBQd")
"""A job result's fixed fields: job id, success flag, bytes moved, seconds (then its keys)."""


class Message:
    """One message type: a frozen dataclass with a fixed `TYPE` code and its payload encoding."""

    TYPE: ClassVar[int]

    def write(self, w: FieldWriter) -> None:
        """Append this message's fields to `w` (nothing, for a message without fields)."""

    @classmethod
    def read(cls, r: FieldReader) -> Message:
        """The message whose fields `r` holds (`cls()` for a message without fields)."""
        return cls()


@dataclass(frozen=True)
class LookupRequest(Message):
    """Engine → tier: are these chunks there? Answered by a `LookupReply` with the same `req_id`."""

    TYPE = 1
    req_id: int
    keys: tuple[ChunkKey, ...]

    def write(self, w: FieldWriter) -> None:
        w.pack(U64, self.req_id)
        w.keys(self.keys)

    @classmethod
    def read(cls, r: FieldReader) -> LookupRequest:
        return cls(r.unpack(U64), r.keys())


@dataclass(frozen=True)
class LookupReply(Message):
    """Tier → engine: one answer per key of the request `req_id`, in its order."""

    TYPE = 2
    req_id: int
    results: tuple[LookupResult, ...]

    def write(self, w: FieldWriter) -> None:
        w.pack(U64, self.req_id)
        w.pack(U32, len(self.results))
        w.parts.append(bytes(LookupResult(result) for result in self.results))

    @classmethod
    def read(cls, r: FieldReader) -> LookupReply:
        req_id, answers = r.unpack(U64), r.take(r.unpack(U32)).tobytes()
        if answers and max(answers) >= len(_LOOKUP_RESULTS):
            raise MessageError(f"no LookupResult has the value {max(answers)}")
        return cls(req_id, tuple(map(_LOOKUP_RESULTS.__getitem__, answers)))


@dataclass(frozen=True)
class JobRequest(Message):
    """Engine → tier: a store or load job to submit (`SecondaryTier.submit_store`/`submit_load`)."""

    TYPE = 3
    job: Job

    def write(self, w: FieldWriter) -> None:
        w.pack(U64, self.job.job_id)
        w.member(self.job.kind)
        w.keys(self.job.keys)
        w.pack(U32, len(self.job.slots))
        for slot in self.job.slots:
            w.pack(U32, slot)

    @classmethod
    def read(cls, r: FieldReader) -> JobRequest:
        job_id, kind, keys = r.unpack(U64), r.member(JobKind), r.keys()
        slots = tuple(r.unpack(U32) for _ in range(r.unpack(U32)))
        if len(slots) != len(keys):
            raise MessageError(f"job {job_id}: {len(keys)} keys but {len(slots)} slots")
        return cls(Job(job_id, kind, keys, slots))


@dataclass(frozen=True)
class JobsDone(Message):
    """Tier → engine: jobs that finished, each with the keys it moved."""

    TYPE = 4
    results: tuple[JobResult, ...]

    def write(self, w: FieldWriter) -> None:
        w.pack(U32, len(self.results))
        for res in self.results:
            w.pack(_RESULT, res.job_id, bool(res.success), res.bytes_moved, res.seconds)
            w.keys(res.successful_keys)

    @classmethod
    def read(cls, r: FieldReader) -> JobsDone:
        results = []
        for _ in range(r.unpack(U32)):
            job_id, success, bytes_moved, seconds = r.record(_RESULT)
            if success > 1:
                raise MessageError(f"a flag is 0 or 1, not {success}")
            results.append(JobResult(job_id, success == 1, r.keys(), bytes_moved, seconds))
        return cls(tuple(results))

    def parts(self) -> Iterator[JobsDone]:
        """This batch as frames of at most `MAX_RESULTS_PER_FRAME` results."""
        for at in range(0, len(self.results), MAX_RESULTS_PER_FRAME):
            yield JobsDone(self.results[at:at + MAX_RESULTS_PER_FRAME])


@dataclass(frozen=True)
class EventsReport(Message):
    """Tier → engine: chunks became available in the tier, or left it (`SecondaryTier.take_events`)."""

    TYPE = 5
    events: tuple[TierEvent, ...]

    def write(self, w: FieldWriter) -> None:
        w.pack(U32, len(self.events))
        for event in self.events:
            w.member(event.kind)
            w.keys(event.keys)

    @classmethod
    def read(cls, r: FieldReader) -> EventsReport:
        return cls(tuple(TierEvent(r.member(TierEventKind), r.keys()) for _ in range(r.unpack(U32))))

    def parts(self) -> Iterator[EventsReport]:
        """These events as frames of one event each, of at most `MAX_KEYS_PER_EVENT` keys."""
        for event in self.events:
            for at in range(0, len(event.keys), MAX_KEYS_PER_EVENT):
                yield EventsReport((TierEvent(event.kind, event.keys[at:at + MAX_KEYS_PER_EVENT]),))


@dataclass(frozen=True)
class StatsRequest(Message):
    """Engine → tier: send a `StatsReport` now (after the jobs finished so far)."""

    TYPE = 6


@dataclass(frozen=True)
class StatsReport(Message):
    """Tier → engine: the tier's counts since it was built and its fill (`SecondaryTier.counts`,
    `usage`; None: the tier does not report one)."""

    TYPE = 7
    counts: TierCounts
    usage: TierUsage | None

    def write(self, w: FieldWriter) -> None:
        w.pack(U32, len(self.counts.values))
        for stat, value in self.counts.values.items():
            w.pack(U8, _STAT_FAMILIES.index(type(stat)))
            w.text(stat.value)
            w.pack(F64, value)
        w.flag(self.usage is not None)
        if self.usage is not None:
            for gauge in (self.usage.bytes_used, self.usage.chunks, self.usage.capacity_bytes):
                w.pack(U64, gauge)

    @classmethod
    def read(cls, r: FieldReader) -> StatsReport:
        values: dict[TierStat, float] = {}
        for _ in range(r.unpack(U32)):
            family = r.unpack(U8)
            if family >= len(_STAT_FAMILIES):
                raise MessageError(f"unknown kind of tier count {family}")
            name = r.text()
            try:
                stat = _STAT_FAMILIES[family](name)
            except ValueError as e:
                raise MessageError(f"unknown tier count {name!r}") from e
            values[stat] = r.real()
        usage = TierUsage(r.unpack(U64), r.unpack(U64), r.unpack(U64)) if r.flag() else None
        return cls(TierCounts(values), usage)


@dataclass(frozen=True)
class Ready(Message):
    """Tier → engine, once: the tier is built. `loads_own_stores`: a finished store proves a later
    load of its keys (`SecondaryTier.loads_own_stores`); `endpoints`: `SecondaryTier.endpoints()`."""

    TYPE = 8
    loads_own_stores: bool
    endpoints: Mapping[str, str] = field(default_factory=dict)

    def write(self, w: FieldWriter) -> None:
        w.flag(self.loads_own_stores)
        w.pack(U32, len(self.endpoints))
        for role, address in self.endpoints.items():
            w.text(role)
            w.text(address)

    @classmethod
    def read(cls, r: FieldReader) -> Ready:
        loads_own_stores, endpoints = r.flag(), {}
        for _ in range(r.unpack(U32)):
            role = r.text()
            endpoints[role] = r.text()
        return cls(loads_own_stores, endpoints)


@dataclass(frozen=True)
class ErrorReport(Message):
    """Tier → engine: the tier could not be built or cannot go on. With `key` set, a `ConfigError`
    of the tier's options: the option `key`, its `value` and what is `allowed`."""

    TYPE = 9
    message: str
    key: str | None = None
    value: Scalar = None
    allowed: str = ""

    def write(self, w: FieldWriter) -> None:
        w.text(self.message)
        w.flag(self.key is not None)
        if self.key is not None:
            w.text(self.key)
            w.scalar(self.value)
            w.text(self.allowed)

    @classmethod
    def read(cls, r: FieldReader) -> ErrorReport:
        message = r.text()
        if not r.flag():
            return cls(message)
        return cls(message, r.text(), r.scalar(), r.text())


@dataclass(frozen=True)
class Shutdown(Message):
    """Engine → tier: shut the tier down and exit."""

    TYPE = 10


MESSAGE_TYPES: dict[int, type[Message]] = {cls.TYPE: cls for cls in (
    LookupRequest, LookupReply, JobRequest, JobsDone, EventsReport, StatsRequest, StatsReport,
    Ready, ErrorReport, Shutdown,
)}


def encode(msg: Message) -> bytes:
    """`msg` as one frame. Raises MessageError when a field cannot be represented."""
    w = FieldWriter()
    try:
        msg.write(w)
    except (TypeError, ValueError, AttributeError) as e:
        raise MessageError(f"{type(msg).__name__} cannot be encoded: {e}") from e
    payload = b"".join(w.parts)
    if len(payload) > MAX_PAYLOAD:
        raise MessageError(f"{type(msg).__name__} of {len(payload)} bytes is over {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, VERSION, msg.TYPE, len(payload)) + payload


def _check_header(header: bytes | bytearray | memoryview) -> tuple[type[Message], int]:
    magic, version, kind, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise MessageError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise MessageError(f"format version {version}, this reader speaks {VERSION}")
    if kind not in MESSAGE_TYPES:
        raise MessageError(f"unknown message type {kind}")
    if length > MAX_PAYLOAD:
        raise MessageError(f"declared payload of {length} bytes is over {MAX_PAYLOAD}")
    return MESSAGE_TYPES[kind], length


def _decode_payload(cls: type[Message], payload: bytes | bytearray | memoryview) -> Message:
    r = FieldReader(payload)
    try:
        msg = cls.read(r)
    except (struct.error, ValueError, OverflowError) as e:
        raise MessageError(f"malformed {cls.__name__}: {e}") from e
    r.end()
    return msg


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """The message in `frame` (exactly one frame). Raises MessageError, and only that."""
    if len(frame) < HEADER.size:
        raise MessageError(f"truncated header: {len(frame)} of {HEADER.size} bytes")
    cls, length = _check_header(memoryview(frame)[:HEADER.size])
    if len(frame) - HEADER.size != length:
        raise MessageError(f"header declares {length} payload bytes, {len(frame) - HEADER.size} follow")
    return _decode_payload(cls, memoryview(frame)[HEADER.size:])


def _recv_exact(sock: socket.socket, n: int, *, frame_start: bool) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if frame_start and got == 0:
                raise EOFError("the peer closed the socket")
            raise MessageError(f"truncated frame: the peer closed after {got} of {n} bytes")
        got += k
    return buf


def read_message(sock: socket.socket) -> Message:
    """Block until one whole message is read off `sock` (nothing past it is consumed).

    Raises EOFError when the peer closed the socket between frames, MessageError on a malformed or
    cut frame (the stream cannot be trusted after it), OSError from the socket."""
    cls, length = _check_header(_recv_exact(sock, HEADER.size, frame_start=True))
    return _decode_payload(cls, _recv_exact(sock, length, frame_start=False))


def send_message(sock: socket.socket, msg: Message) -> None:
    """Write `msg` as one frame (blocking until the socket took it all)."""
    sock.sendall(encode(msg))

