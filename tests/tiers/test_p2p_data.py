"""The p2p data path in one process: a real `P2PServer` over a bytearray region, a real `Fetcher`.

Covers what the two-process tests cannot steer: the per-piece checksums, a slot reused while its row
is being sent (the row is aborted, the connection goes on), and many keys per request.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from kvtier.tiers.base import TierContext
from kvtier.tiers.common import chunkfmt
from kvtier.tiers.common.book import FailureLog, TierBook
from kvtier.tiers.p2p import protocol, rowhash
from kvtier.tiers.p2p.auth import Secret
from kvtier.tiers.p2p.fetch import Fetcher
from kvtier.tiers.p2p.index import ChunkIndex, Claim
from kvtier.tiers.p2p.server import P2PServer
from tests.conftest import LAYOUT_FP, random_key

SECRET = Secret(b"p2p-data-test-secret-0123")
FP = bytes.fromhex(LAYOUT_FP)
ROW = 3 * rowhash.PIECE_BYTES + 4096  # four pieces, the last one short
SLOTS = 6


class Holder:
    """A serving half over its own region, and a requester's fetcher pointed at it."""

    def __init__(self, idle_timeout_s: float = 30) -> None:
        self.region = memoryview(bytearray(os.urandom(ROW * SLOTS)))
        self.index = ChunkIndex(SLOTS)
        self.spans = rowhash.piece_spans(ROW)
        ctx = TierContext(self.region, ROW, SLOTS, LAYOUT_FP, "holder")
        self.book = TierBook(ctx)
        self.zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.server = P2PServer(
            self.zctx, "tcp://127.0.0.1:0", SECRET, self.index, self.region, ROW, FP, os.urandom(16),
            self.book, FailureLog(ctx.log, "holder"), max_connections=4, handshake_timeout_s=5,
            idle_timeout_s=idle_timeout_s, transfer_timeout_s=5,
        )
        self.address = ("127.0.0.1", self.server.data_port)
        self.requester = TierBook(TierContext(memoryview(bytearray(0)), ROW, 0, LAYOUT_FP, "req"))
        self.fetcher = Fetcher(SECRET, FP, ROW, self.requester, FailureLog(ctx.log, "req"),
                               connect_timeout_s=2, transfer_timeout_s=5, reconnect_interval_s=1)

    def row(self, slot: int) -> memoryview:
        return self.region[slot * ROW : (slot + 1) * ROW]

    def store(self, key: bytes, slot: int) -> None:
        self.index.remember(key, Claim(slot, *rowhash.row_digests(self.row(slot), self.spans)))

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
def test_piecewise_digest_is_the_chunk_checksum(row_bytes: int) -> None:
    row = memoryview(os.urandom(row_bytes))
    spans = rowhash.piece_spans(row_bytes)
    assert spans[0][0] == 0 and spans[-1][1] == row_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    whole, pieces = rowhash.row_digests(row, spans)
    assert whole == chunkfmt.checksum(row)
    assert len(pieces) == rowhash.PIECE_DIGEST_BYTES * len(spans)
    assert all(rowhash.piece_matches(row[a:b], pieces, i) for i, (a, b) in enumerate(spans))
    assert not rowhash.piece_matches(row[spans[0][0] : spans[0][1] - 1], pieces, 0)


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
    counts = holder.book.counters()
    assert counts["data_requests"] == 1 and counts["chunks_served"] == 4 and counts["serve_misses"] == 2


def test_a_slot_reused_mid_row_aborts_the_row_and_the_connection_goes_on(holder: Holder) -> None:
    stale, fresh, early = random_key(), random_key(), random_key()
    holder.store(stale, 0)
    holder.store(fresh, 1)
    holder.store(early, 2)
    holder.row(0)[ROW - 10 :] = os.urandom(10)  # the host tier rewrote the end of slot 0
    holder.row(2)[:10] = os.urandom(10)  # and the start of slot 2
    outs = [memoryview(bytearray(ROW)) for _ in range(3)]
    assert holder.fetcher.fetch(holder.address, list(zip([stale, fresh, early], outs, strict=True))) \
        == [False, True, False]
    assert bytes(outs[1]) == bytes(holder.row(1))
    # The aborted row carries only pieces that matched, then zeros: never the new bytes.
    last = holder.spans[-1][0]
    assert bytes(outs[0][:last]) == bytes(holder.row(0)[:last]) and not any(outs[0][last:])
    counts = holder.book.counters()
    assert counts["serve_aborted"] == 1 and counts["serve_misses"] == 1
    assert holder.index.holds([stale, fresh, early]) == [False, True, False]
    assert holder.requester.counters()["load_misses"] == 2
    assert "peer_errors" not in holder.requester.counters() and holder.server.connections() == 1
    again = memoryview(bytearray(ROW))
    assert holder.fetcher.fetch(holder.address, [(fresh, again)]) == [True]
    assert holder.server.connections() == 1


def test_a_wrong_checksum_from_the_holder_is_a_bad_chunk(holder: Holder) -> None:
    key = random_key()
    whole, pieces = rowhash.row_digests(holder.row(3), holder.spans)
    holder.index.remember(key, Claim(3, bytes(16), pieces))  # the header will carry a wrong digest
    out = memoryview(bytearray(ROW))
    assert holder.fetcher.fetch(holder.address, [(key, out)]) == [False]
    assert whole != bytes(16) and holder.requester.counters()["bad_chunks"] == 1


def test_requests_sent_ahead_are_answered_in_order_on_one_connection(holder: Holder) -> None:
    keys = [random_key() for _ in range(4)]
    for slot, key in enumerate(keys):
        holder.store(key, slot)
    outs = [memoryview(bytearray(ROW)) for _ in keys]
    first = holder.fetcher.send(holder.address, list(zip(keys[:3], outs[:3], strict=True)))
    second = holder.fetcher.send(holder.address, [(keys[3], outs[3])])
    assert holder.fetcher.complete(first) == [True] * 3 and holder.fetcher.complete(second) == [True]
    assert [bytes(o) for o in outs] == [bytes(holder.row(s)) for s in range(4)]
    assert holder.book.counters()["data_requests"] == 2 and holder.server.connections() == 1


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
    assert "peer_errors" not in holder.requester.counters()


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
