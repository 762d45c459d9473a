"""The p2p data path in one process: a real `P2PServer` over a bytearray region, a real `Fetcher`.

Covers what the two-process tests cannot steer: a slot reused before or while its row is being sent
(a real race: the server's thread sends while the test's thread reuses the slot; the row is voided,
the connection goes on), a row changed in place (the requester's checksum rejects it), and many
keys per request.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import xxhash
import zmq

from kvtier.format.chunks import ChunkError
from kvtier.ops.metrics import TierCounter
from kvtier.tiers.base import TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.common.fleetkey import FleetKey
from kvtier.tiers.p2p import protocol, rowhash
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.fetch import Fetcher
from kvtier.tiers.p2p.index import ChunkIndex, Claim
from kvtier.tiers.p2p.row_server import P2PServer
from tests.conftest import LAYOUT_FP, random_key, wait_until

SECRET = Secret(b"p2p-data-test-secret-0123")
FP = bytes.fromhex(LAYOUT_FP)
ROW = 3 * rowhash.PIECE_BYTES + 4096  # four pieces, the last one short
SLOTS = 6


class Holder:
    """A serving half over its own region (rows of `row_bytes`, with slot generations), and a
    requester's fetcher pointed at it."""

    def __init__(self, idle_timeout_s: float = 30, row_bytes: int = ROW, slots: int = SLOTS,
                 fleet: FleetKey | None = None, requester_fleet: FleetKey | None = None) -> None:
        self.row_bytes = row_bytes
        self.fleet = fleet
        self.region = memoryview(bytearray(os.urandom(row_bytes * slots)))
        self.generations = memoryview(bytearray(8 * slots)).cast("Q")
        self.index = ChunkIndex(slots)
        self.spans = rowhash.piece_spans(row_bytes)
        ctx = TierContext(self.region, row_bytes, slots, LAYOUT_FP, "holder", self.generations)
        self.book = TierBook(ctx)
        self.zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.server = P2PServer(
            self.zctx, "tcp://127.0.0.1:0", SECRET, self.index, self.region, self.generations,
            row_bytes, FP, os.urandom(16),
            self.book, FailureLog(ctx.log, "holder"), max_connections=4, handshake_timeout_s=5,
            idle_timeout_s=idle_timeout_s, transfer_timeout_s=5, fleet=fleet,
        )
        self.address = ("127.0.0.1", self.server.data_port)
        self.requester = TierBook(TierContext(memoryview(bytearray(0)), row_bytes, 0, LAYOUT_FP, "req"))
        self.fetcher = Fetcher(SECRET, FP, row_bytes, self.requester, FailureLog(ctx.log, "req"),
                               connect_timeout_s=2, transfer_timeout_s=5, reconnect_interval_s=1,
                               fleet=requester_fleet)

    def row(self, slot: int) -> memoryview:
        return self.region[slot * self.row_bytes : (slot + 1) * self.row_bytes]

    def store(self, key: bytes, slot: int) -> None:
        """What a STORE job does: remember the slot's digest (checksum, or MAC under a fleet key)
        and generation."""
        digest = chunkfmt.digest_of(key, FP, self.row(slot), self.fleet)
        self.index.remember(key, Claim(slot, digest, self.generations[slot]))

    def reuse(self, slot: int) -> bytes:
        """What the host tier and a writer do to a reused slot: a new generation, then new bytes."""
        self.generations[slot] += 1
        data = os.urandom(self.row_bytes)
        self.row(slot)[:] = data
        return data

    def close(self) -> None:
        self.fetcher.close()
        self.server.close()
        self.zctx.term()


@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder()
    yield h
    h.close()


@pytest.fixture
def idle_closing_holder() -> Iterator[Holder]:
    h = Holder(idle_timeout_s=0.2)
    yield h
    h.close()


@pytest.mark.parametrize("row_bytes", [4096, rowhash.PIECE_BYTES, ROW, 5 * rowhash.PIECE_BYTES])
def test_the_requesters_piecewise_digest_is_the_chunk_checksum(row_bytes: int) -> None:
    row = memoryview(os.urandom(row_bytes))
    spans = rowhash.piece_spans(row_bytes)
    assert spans[0][0] == 0 and spans[-1][1] == row_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    whole = xxhash.xxh3_128()
    for a, b in spans:
        whole.update(row[a:b])
    assert whole.digest() == chunkfmt.checksum(row)


def test_one_request_carries_many_keys_hits_and_misses(holder: Holder) -> None:
    keys = [random_key() for _ in range(SLOTS)]
    for slot, key in enumerate(keys[:4]):
        holder.store(key, slot)
    order = [keys[0], keys[4], keys[1], keys[2], keys[5], keys[3]]  # keys[4:] are not held
    outs = [memoryview(bytearray(ROW)) for _ in order]
    assert holder.fetcher.fetch(holder.address, list(zip(order, outs, strict=True))) == \
        [True, False, True, True, False, True]
    for key, out in zip(order, outs, strict=True):
        if key in keys[:4]:
            assert bytes(out) == bytes(holder.row(keys.index(key)))
    counts = holder.book.counts()
    assert counts[TierCounter.DATA_REQUESTS] == 1 and counts[TierCounter.CHUNKS_SERVED] == 4
    assert counts[TierCounter.SERVE_MISSES] == 2


def test_a_reused_slot_is_a_miss_and_a_row_changed_in_place_is_rejected(holder: Holder) -> None:
    reused, fresh, changed = random_key(), random_key(), random_key()
    holder.store(reused, 0)
    holder.store(fresh, 1)
    holder.store(changed, 2)
    holder.reuse(0)
    holder.row(2)[ROW - 10 :] = os.urandom(10)  # corrupted in place: no new generation
    outs = [memoryview(bytearray(ROW)) for _ in range(3)]
    assert holder.fetcher.fetch(holder.address, list(zip([reused, fresh, changed], outs, strict=True))) \
        == [False, True, False]
    assert bytes(outs[1]) == bytes(holder.row(1))
    assert not any(outs[0])  # a miss: no byte of the reused slot was sent
    counts = holder.book.counts()
    assert counts[TierCounter.SERVE_MISSES] == 1 and counts[TierCounter.CHUNKS_SERVED] == 2
    assert holder.index.holds([reused, fresh, changed]) == [False, True, True]
    assert holder.requester.counts()[TierCounter.LOAD_MISSES] == 1
    assert holder.requester.counts().bad_chunks == 1  # the requester's checksum caught it
    assert holder.requester.counts()[TierCounter.PEER_ERRORS] == 0 and holder.server.connections() == 1
    again = memoryview(bytearray(ROW))
    assert holder.fetcher.fetch(holder.address, [(fresh, again)]) == [True]
    assert holder.server.connections() == 1


BIG_ROW = 16 << 20
"""More than loopback's socket buffers hold: a holder sending one such row to a requester that
stops reading blocks mid-row."""


def wait_until_sending_is_blocked(holder: Holder) -> None:
    """Until the holder's one data connection cannot take another byte (the kernel's send buffer is
    full: `select` no longer reports it writable), so its serving thread, in `sendall`, waits for the
    requester to read."""
    with holder.server._lock:
        [conn] = holder.server._conns
    wait_until(lambda: not select.select([], [conn], [], 0)[1], "the holder blocked mid-row")


@pytest.fixture
def big_holder() -> Iterator[Holder]:
    h = Holder(row_bytes=BIG_ROW, slots=2)
    yield h
    h.close()


def test_a_slot_reused_while_its_row_is_being_sent_voids_the_row(big_holder: Holder) -> None:
    """A real race: the server's thread is blocked sending the row (the requester stopped reading)
    while this thread reuses the slot; the rest of the row after the piece in flight goes as
    zeros, never the new chunk's bytes, and the trailer voids the row."""
    holder, block, header = big_holder, protocol.BLOCK, chunkfmt.HEADER_BYTES
    key, other = random_key(), random_key()
    holder.store(key, 0)
    holder.store(other, 1)
    old = bytes(holder.row(0))
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        conn.settimeout(10)
        conn.connect(holder.address)
        protocol.client_handshake(conn, SECRET, FP, BIG_ROW)
        conn.sendall(protocol.encode_get([key, other]))
        first = protocol.recv_bytes(conn, block + header + rowhash.PIECE_BYTES)
        wait_until_sending_is_blocked(holder)
        assert holder.book.counts()[TierCounter.CHUNKS_SERVED] == 0
        new = holder.reuse(0)
        rest = protocol.recv_bytes(conn, BIG_ROW - rowhash.PIECE_BYTES + block)
        answer = first + rest
        row, trailer = answer[block + header : block + header + BIG_ROW], answer[-block:]
        piece = rowhash.PIECE_BYTES
        assert row[:piece] == old[:piece]
        assert row[-piece:] == bytes(piece) != new[-piece:]  # the race happened: zeros follow
        pieces = [row[i : i + piece] for i in range(0, BIG_ROW, piece)]
        mixed = [i for i, p in enumerate(pieces) if p not in (old[i * piece : (i + 1) * piece], bytes(piece))]
        assert len(mixed) <= 1  # only the piece in flight may carry the new chunk's bytes
        assert trailer == protocol.TRAILER_ABORTED
        # The connection goes on: the next key of the request is served whole.
        second = protocol.recv_bytes(conn, block + header + BIG_ROW + block)
        assert second[:block] == protocol.STATUS_CHUNK and second[-block:] == protocol.TRAILER_OK
        assert second[block + header : -block] == bytes(holder.row(1))
    counts = holder.book.counts()
    assert counts[TierCounter.SERVE_ABORTED] == 1 and counts[TierCounter.CHUNKS_SERVED] == 1
    assert holder.index.holds([key, other]) == [False, True]


def test_the_requester_never_accepts_a_row_whose_slot_was_reused_during_the_send(
    big_holder: Holder,
) -> None:
    """The fetcher loads while another thread reuses the slot a moment later, many times: every
    row it reports loaded is the stored one; the voided ones are failed loads, not bad chunks."""
    holder, verdicts = big_holder, []
    for delay_ms in itertools.islice(itertools.cycle([0, 1, 2, 4]), 16):
        key = random_key()
        holder.store(key, 0)
        stored = bytes(holder.row(0))
        out = memoryview(bytearray(BIG_ROW))
        reuser = threading.Timer(delay_ms / 1000, holder.reuse, args=(0,))
        reuser.start()
        [loaded] = holder.fetcher.fetch(holder.address, [(key, out)])
        reuser.join()
        if loaded:
            assert bytes(out) == stored
        verdicts.append(loaded)
    counts, served = holder.requester.counts(), holder.book.counts()
    assert counts[TierCounter.LOAD_MISSES] == verdicts.count(False)
    assert counts.bad_chunks == 0 and counts[TierCounter.PEER_ERRORS] == 0
    assert served[TierCounter.SERVE_ABORTED] >= 1  # the race was caused, mid-row, at least once


def test_a_wrong_checksum_from_the_holder_is_a_bad_chunk(holder: Holder) -> None:
    key = random_key()
    holder.index.remember(key, Claim(3, bytes(16), holder.generations[3]))  # a wrong digest in the header
    out = memoryview(bytearray(ROW))
    assert holder.fetcher.fetch(holder.address, [(key, out)]) == [False]
    assert chunkfmt.checksum(holder.row(3)) != bytes(16) and holder.requester.counts().bad_chunks == 1


def test_requests_sent_ahead_are_answered_in_order_on_one_connection(holder: Holder) -> None:
    keys = [random_key() for _ in range(4)]
    for slot, key in enumerate(keys):
        holder.store(key, slot)
    outs = [memoryview(bytearray(ROW)) for _ in keys]
    first = holder.fetcher.send(holder.address, list(zip(keys[:3], outs[:3], strict=True)))
    second = holder.fetcher.send(holder.address, [(keys[3], outs[3])])
    assert holder.fetcher.complete(first) == [True] * 3 and holder.fetcher.complete(second) == [True]
    assert [bytes(o) for o in outs] == [bytes(holder.row(s)) for s in range(4)]
    assert holder.book.counts()[TierCounter.DATA_REQUESTS] == 2 and holder.server.connections() == 1


def test_requests_sent_ahead_on_a_connection_the_holder_closed_go_out_again(
    idle_closing_holder: Holder,
) -> None:
    holder = idle_closing_holder
    key = random_key()
    holder.store(key, 0)
    assert holder.fetcher.fetch(holder.address, [(key, memoryview(bytearray(ROW)))]) == [True]
    deadline = time.monotonic() + 5
    while holder.server.connections():  # the holder closes the idle connection
        assert time.monotonic() < deadline
        time.sleep(0.05)
    outs = [memoryview(bytearray(ROW)) for _ in range(2)]
    requests = [holder.fetcher.send(holder.address, [(key, out)]) for out in outs]
    assert [holder.fetcher.complete(r) for r in requests] == [[True], [True]]
    assert all(bytes(out) == bytes(holder.row(0)) for out in outs)
    assert holder.requester.counts()[TierCounter.PEER_ERRORS] == 0


def test_answers_come_in_whole_blocks_so_rows_arrive_aligned(holder: Holder) -> None:
    held, missing = random_key(), random_key()
    holder.store(held, 1)
    block, header = protocol.BLOCK, chunkfmt.HEADER_BYTES
    with socket.create_connection(holder.address, timeout=5) as conn:
        protocol.client_handshake(conn, SECRET, FP, ROW)
        conn.sendall(protocol.encode_get([held, missing]))
        answer = protocol.recv_bytes(conn, block + header + ROW + 2 * block)
        conn.settimeout(0.2)
        with pytest.raises(TimeoutError):
            conn.recv(1)  # nothing beyond the two answers
    assert ROW % block == 0 and header % block == 0
    assert answer[:block] == protocol.STATUS_CHUNK
    assert chunkfmt.check_header(answer[block : block + header], held, FP, ROW)[0] is None
    assert answer[block + header : block + header + ROW] == bytes(holder.row(1))
    assert answer[-2 * block :] == protocol.TRAILER_OK + protocol.STATUS_MISS


def test_under_a_fleet_key_only_rows_sealed_with_it_load() -> None:
    """With a fleet key a row's digest is the chunk's keyed MAC: a holder with the key serves rows
    that load; a peer that passes the p2p handshake but seals without the key, or with another,
    serves rows that are read, refused and counted as a bad MAC, on a connection that goes on."""
    key_a, key_b = FleetKey.from_bytes(os.urandom(32)), FleetKey.from_bytes(os.urandom(32))
    for holder_key, requester_key, loads in ((key_a, key_a, True), (None, key_a, False),
                                             (key_b, key_a, False), (key_a, None, False)):
        h = Holder(fleet=holder_key, requester_fleet=requester_key)
        try:
            key = random_key()
            h.store(key, 2)
            out = memoryview(bytearray(ROW))
            assert h.fetcher.fetch(h.address, [(key, out)]) == [loads]
            counts = h.requester.counts()
            assert counts.bad_chunks == (0 if loads else 1)
            assert counts[ChunkError.MAC] == (0 if loads else 1)
            other = random_key()
            h.store(other, 4)  # the connection was not broken by a refused row
            assert h.fetcher.fetch(h.address, [(other, out)]) == [loads]
        finally:
            h.close()
