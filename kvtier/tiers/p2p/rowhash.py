"""Checksums of a host row computed piece by piece, so every pass over a row stays in the L2 cache.

A row is cut into pieces of PIECE_BYTES (the last one may be shorter). At STORE time the holder
computes, in one pass over each piece while it is hot: the xxh3-128 of the whole row (the chunk
header's checksum, `chunkfmt.checksum`; streaming gives the same digest) and an xxh3-64 digest per
piece. When it serves the row later, it checks each piece against its digest right before sending
that piece, so a slot the host tier reused is never sent on (see `server`). The requester feeds
each piece it receives to a streaming xxh3-128 while the piece is still in cache (`fetch`).
"""

from __future__ import annotations

import xxhash

PIECE_BYTES = 512 << 10
"""Piece size: half of a 1 MiB L2 cache, so a piece read once is still there for the next pass."""
PIECE_DIGEST_BYTES = 8


def piece_spans(row_bytes: int) -> list[tuple[int, int]]:
    """(start, end) of every piece of a row of `row_bytes` bytes, in order."""
    return [(off, min(off + PIECE_BYTES, row_bytes)) for off in range(0, row_bytes, PIECE_BYTES)]


def row_digests(row: memoryview, spans: list[tuple[int, int]]) -> tuple[bytes, bytes]:
    """(xxh3-128 of `row`, its pieces' xxh3-64 digests concatenated), one pass over each piece."""
    whole = xxhash.xxh3_128()
    parts = []
    for start, end in spans:
        piece = row[start:end]
        parts.append(xxhash.xxh3_64_digest(piece))
        whole.update(piece)
    return whole.digest(), b"".join(parts)


def piece_matches(piece: memoryview, digests: bytes, index: int) -> bool:
    """Whether `piece` (the `index`-th of its row) still has the digest remembered for it."""
    at = index * PIECE_DIGEST_BYTES
    return xxhash.xxh3_64_digest(piece) == digests[at : at + PIECE_DIGEST_BYTES]
