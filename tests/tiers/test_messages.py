"""The frames between the engine and a tier process: every message type round-trips; malformed
frames, fed to the decoder or sent by a real tier process, raise `MessageError` or mark the tier
down, never anything else."""

from __future__ import annotations

import queue
import random
import socket
import struct
import time

import pytest

from kvtier.format.chunks import ChunkError, TierEvent, TierEventKind
from kvtier.host.region import HostRegion
from kvtier.ops.metrics import TierCounter, TierCounts, TierGauge
from kvtier.tiers.base import Job, JobKind, JobResult, LookupResult, TierUsage
from kvtier.tiers.channel import Inbound, TierChannel
from kvtier.tiers.codec import MessageError
from kvtier.tiers.messages import (
    HEADER,
    MAGIC,
    MAX_KEYS_PER_EVENT,
    MAX_PAYLOAD,
    MAX_RESULTS_PER_FRAME,
    MESSAGE_TYPES,
    VERSION,
    ErrorReport,
    EventsReport,
    JobRequest,
    JobsDone,
    LookupReply,
    LookupRequest,
    Message,
    Ready,
    Shutdown,
    StatsReport,
    StatsRequest,
    decode,
    encode,
    read_message,
    send_message,
)
from tests.conftest import random_key, wait_jobs
from tests.tiers.process_helpers import make_proc

K1, K2, K3 = (bytes([i]) * 32 for i in (1, 2, 3))
SAMPLES: list[Message] = [
    LookupRequest(7, (K1, K2, b"", b"short")),
    LookupRequest(2**64 - 1, ()),
    LookupReply(7, (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY)),
    JobRequest(Job(3, JobKind.STORE, (K1, K2), (0, 31))),
    JobRequest(Job(4, JobKind.LOAD, (K3,), (2**32 - 1,))),
    JobsDone((JobResult(3, True, (K1, K2), 8192, 0.25), JobResult(4, False), JobResult(5, False, (K3,)))),
    EventsReport((TierEvent(TierEventKind.STORED, (K1, K2)), TierEvent(TierEventKind.REMOVED, (K3,)))),
    StatsRequest(),
    StatsReport(TierCounts({TierCounter.LOOKUPS_SERVED: 3.0, ChunkError.CHECKSUM: 1.0,
                            TierGauge.PEERS: 2.5}), TierUsage(1 << 40, 12, 0)),
    StatsReport(TierCounts(), None),
    Ready(True, {"data": "tcp://127.0.0.1:4242", "lookup": "tcp://[::1]:9"}),
    Ready(False, {}),
    ErrorReport("OSError: no such file"),
    ErrorReport("kvtier config: ...", "max_bytes", 5, "at least one row"),
    ErrorReport("é", "a", 10**40, "any size of int"),
    ErrorReport("m", "ratio", 0.5, "x"),
    ErrorReport("m", "flag", True, "x"),
    ErrorReport("m", "unset", None, "x"),
    ErrorReport("m", "name", "ünïcode", "x"),
    Shutdown(),
]


def frame(kind: int, payload: bytes, *, magic: bytes = MAGIC, version: int = VERSION,
          length: int | None = None) -> bytes:
    return HEADER.pack(magic, version, kind, len(payload) if length is None else length) + payload


def test_every_message_type_round_trips() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())
    for msg in SAMPLES:
        data = encode(msg)
        assert data[:4] == MAGIC and decode(data) == msg


def test_frames_read_off_a_socket_one_at_a_time() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(encode(m) for m in SAMPLES))
        assert [read_message(b) for _ in SAMPLES] == SAMPLES
        send_message(a, Shutdown())
        a.sendall(encode(StatsRequest())[:5])
        a.shutdown(socket.SHUT_WR)
        assert read_message(b) == Shutdown()
        with pytest.raises(MessageError, match="truncated frame"):
            read_message(b)
    c, d = socket.socketpair()
    with c, d:
        c.close()
        with pytest.raises(EOFError):
            read_message(d)


def test_large_batches_are_split_into_frames_the_reader_accepts() -> None:
    keys = tuple(random_key() for _ in range(MAX_KEYS_PER_EVENT + 5))
    parts = list(EventsReport((TierEvent(TierEventKind.STORED, keys),)).parts())
    assert [len(p.events[0].keys) for p in parts] == [MAX_KEYS_PER_EVENT, 5]
    assert tuple(k for p in parts for k in decode(encode(p)).events[0].keys) == keys
    results = tuple(JobResult(i, True, (K1,)) for i in range(MAX_RESULTS_PER_FRAME + 1))
    done = list(JobsDone(results).parts())
    assert [len(p.results) for p in done] == [MAX_RESULTS_PER_FRAME, 1]
    assert list(JobsDone(()).parts()) == [] and list(EventsReport(()).parts()) == []


@pytest.mark.parametrize("msg", [
    LookupRequest(-1, ()),
    LookupRequest(1, ("not bytes",)),  # type: ignore[arg-type]
    LookupRequest(1, (b"x" * 65536,)),
    JobRequest(Job(1, JobKind.STORE, (K1,), (2**32,))),
    LookupReply(1, (3,)),  # type: ignore[arg-type]
    Ready(True, {"data": 5}),  # type: ignore[dict-item]
    ErrorReport("m", "k", [1, 2], "x"),  # type: ignore[arg-type]
    JobsDone((JobResult(1, True, (), -1),)),
])
def test_a_message_that_cannot_be_framed_is_a_message_error(msg: Message) -> None:
    with pytest.raises(MessageError):
        encode(msg)


def test_an_oversized_message_is_refused_by_the_encoder() -> None:
    with pytest.raises(MessageError, match="over"):
        encode(ErrorReport("x" * (MAX_PAYLOAD + 1)))


def text(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


ONE_KEY = struct.pack("!IH", 1, 32) + K1
JOB_HEAD = struct.pack("!Q", 1)
CONFIG_ERROR_HEAD = text(b"m") + b"\x01" + text(b"k")  # a message, then a config key follows
MALFORMED: dict[str, tuple[bytes, str]] = {  # name: (frame, what the error says)
    "empty": (b"", "truncated header"),
    "short header": (MAGIC + b"\x00\x01", "truncated header"),
    "bad magic": (frame(StatsRequest.TYPE, b"", magic=b"PKL\x80"), "bad magic"),
    "pickle protocol 4": (b"\x80\x04\x95" + b"\x00" * 20, "bad magic"),
    "older version": (frame(StatsRequest.TYPE, b"", version=VERSION - 1), "format version"),
    "newer version": (frame(StatsRequest.TYPE, b"", version=VERSION + 1), "format version"),
    "type 0": (frame(0, b""), "unknown message type"),
    "unknown type": (frame(max(MESSAGE_TYPES) + 1, b""), "unknown message type"),
    "huge declared length": (frame(JobsDone.TYPE, b"", length=2**32 - 1), "is over"),
    "declared length over the cap": (frame(JobsDone.TYPE, b"", length=MAX_PAYLOAD + 1), "is over"),
    "declared length short of the payload": (frame(StatsRequest.TYPE, b"\x00", length=0), "header declares"),
    "declared length past the payload": (frame(StatsRequest.TYPE, b"", length=1), "header declares"),
    "bytes after the last field": (frame(Shutdown.TYPE, b"\x00"), "left after"),
    "key count past the payload": (
        frame(LookupRequest.TYPE, struct.pack("!QI", 1, 2**32 - 1)), "truncated payload"),
    "key bytes past the payload": (
        frame(LookupRequest.TYPE, struct.pack("!QIH", 1, 1, 40) + K1), "truncated payload"),
    "flag of 2": (frame(Ready.TYPE, b"\x02" + struct.pack("!I", 0)), "a flag is 0 or 1"),
    "job kind out of range": (
        frame(JobRequest.TYPE, JOB_HEAD + b"\x09" + ONE_KEY + struct.pack("!II", 1, 0)), "no JobKind"),
    "keys without slots": (
        frame(JobRequest.TYPE, JOB_HEAD + b"\x00" + ONE_KEY + struct.pack("!I", 0)), "keys but 0 slots"),
    "lookup answer out of range": (
        frame(LookupReply.TYPE, struct.pack("!QI", 1, 1) + b"\x07"), "no LookupResult"),
    "event kind out of range": (
        frame(EventsReport.TYPE, struct.pack("!IB", 1, 2) + ONE_KEY), "no TierEventKind"),
    "text not UTF-8": (frame(ErrorReport.TYPE, text(b"\xff\xfe") + b"\x00"), "not UTF-8"),
    "unknown count family": (frame(StatsReport.TYPE, struct.pack("!IB", 1, 3)), "kind of tier count"),
    "unknown count name": (
        frame(StatsReport.TYPE, struct.pack("!IB", 1, 0) + text(b"bad") + b"\x00" * 9), "unknown tier count"),
    "unknown value tag": (frame(ErrorReport.TYPE, CONFIG_ERROR_HEAD + b"\x09"), "value tag"),
    "int not a number": (
        frame(ErrorReport.TYPE, CONFIG_ERROR_HEAD + b"\x03" + text(b"1x") + text(b"")), "not an integer"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_each_kind_of_malformed_frame_is_a_message_error(name: str) -> None:
    data, reason = MALFORMED[name]
    with pytest.raises(MessageError, match=reason):
        decode(data)


def test_every_truncation_of_every_message_is_a_message_error() -> None:
    for msg in SAMPLES:
        data = encode(msg)
        for cut in range(len(data)):
            with pytest.raises(MessageError):
                decode(data[:cut])


def _decodes_or_refuses(data: bytes) -> None:
    """Decoding `data` gives a message or raises MessageError, and nothing else."""
    try:
        msg = decode(data)
    except MessageError:
        return
    assert type(msg) in MESSAGE_TYPES.values()


def test_random_bytes_and_garbage_payloads_are_refused_or_decoded_never_crash() -> None:
    rng = random.Random(34)
    for _ in range(3000):
        _decodes_or_refuses(rng.randbytes(rng.randrange(64)))
    for kind in MESSAGE_TYPES:
        for _ in range(500):
            _decodes_or_refuses(frame(kind, rng.randbytes(rng.randrange(80))))
    for msg in SAMPLES:  # every single-byte corruption of every valid frame
        data = bytearray(encode(msg))
        for at in range(len(data)):
            flipped = bytearray(data)
            flipped[at] ^= 1 << rng.randrange(8)
            _decodes_or_refuses(bytes(flipped))


GARBAGE = {
    "bad magic": b"GARBAGE!" * 4,
    "huge declared length": frame(JobsDone.TYPE, b"", length=2**32 - 1),
    "unknown type": frame(999, b""),
    "valid header, garbage payload": frame(JobsDone.TYPE, b"\xff" * 9),
    "the engine's own message": encode(Shutdown()),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_a_tier_process_sending_a_malformed_frame_is_marked_down_and_its_jobs_fail(
        region: HostRegion, name: str) -> None:
    proc = make_proc(region, "MalformedFrameTier", "tests.tiers.malformed_tier",
                     options={"frame_hex": GARBAGE[name].hex()}, restart_backoff_s=0.1)
    proc.start()
    try:
        first_pid = proc.pid
        proc.submit_load(Job(1, JobKind.LOAD, (random_key(),), (1,)))
        proc.submit_store(Job(2, JobKind.STORE, (random_key(),), (0,)))  # the garbage goes out
        results = wait_jobs(proc, 2)
        assert sorted((r.job_id, r.success) for r in results) == [(1, False), (2, False)]
        assert proc.last_failure is not None and proc.last_failure[0] == "error"
        # The engine's thread goes on: lookups answer, a new job fails as a value, at once.
        assert proc.lookup([random_key()]) == [LookupResult.MISS]
        proc.submit_store(Job(3, JobKind.STORE, (random_key(),), (0,)))
        assert [(r.job_id, r.success) for r in proc.get_finished_jobs()] == [(3, False)]
        deadline = time.monotonic() + 10
        while not proc.is_up and time.monotonic() < deadline:
            proc.get_finished_jobs()
            time.sleep(0.01)
        assert proc.is_up and proc.pid != first_pid and proc.restarts == 1
    finally:
        proc.shutdown()


def _next_reply(inbox: queue.SimpleQueue[tuple[int, Inbound]]) -> Inbound:
    """The next thing the runner sent other than its periodic stats reports."""
    while isinstance(msg := inbox.get(timeout=30)[1], StatsReport):
        pass
    return msg


def test_the_runner_answers_a_malformed_frame_with_an_error_and_exits(region: HostRegion) -> None:
    inbox: queue.SimpleQueue[tuple[int, Inbound]] = queue.SimpleQueue()
    spec = dict(make_proc(region, "memory").spec.__dict__)
    channel = TierChannel("t", spec, 1, inbox)
    try:
        assert isinstance(_next_reply(inbox), Ready)
        channel.send(LookupRequest(1, (K1,)))
        assert _next_reply(inbox) == LookupReply(1, (LookupResult.MISS,))
        channel.sock.sendall(frame(LookupRequest.TYPE, struct.pack("!QI", 2, 5)))
        error = _next_reply(inbox)
        assert isinstance(error, ErrorReport) and "malformed" in error.message
        assert _next_reply(inbox) is None  # the stream ended
        assert channel.proc.wait(timeout=10) is not None  # the runner exited
    finally:
        channel.proc.kill()
        channel.proc.wait()
        channel.close()
