"""How the p2p tier cuts a row into pieces for the wire, so every pass over a piece stays in the L2 cache.

A row is cut into pieces of PIECE_BYTES (the last one may be shorter). The holder sends a row piece
by piece (`server`); the requester reads it piece by piece into its slot and feeds each piece to a
streaming digest while the piece is still in cache (`fetch`): xxh3-128, or under a fleet key its
keyed MAC, the same digest as the chunk header's of the whole row (`chunkfmt.digest_of`).
"""

from __future__ import annotations

PIECE_BYTES = 512 << 10
"""Piece size: half of a 1 MiB L2 cache, so a piece read once is still there for the next pass."""


def piece_spans(row_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of every piece of a row of `row_bytes` bytes, in order."""
    return [(off, min(off + PIECE_BYTES, row_bytes)) for off in range(0, row_bytes, PIECE_BYTES)]
