"""Slot generations: how often the host tier has handed out each slot of the host region for writing.

One native-endian uint64 per slot, kept in the host region's shared segment right after the rows
(at `offset`), so every process that maps the region reads the same words. The host tier, on the
scheduler's one owning thread, increments slot `s`'s word in `reserve` when it hands `s` out,
before the job that fills the slot exists; nothing writes a slot's bytes outside such an
allocation (`TierContext`: a slot is written only while a LOAD job naming it is in flight). So a
process that reads a slot's generation, then the row, then the generation again, and sees the same
value both times, read bytes of that one allocation (a seqlock read; the row's bytes are read
before the second load of the word: the p2p server's kernel copy ends before its system call
returns). Words are 8-byte aligned, so each load and store of one is a single access.

Processes that count the region's rows as `size // row_bytes` may count one more row over these
words; the host tier never hands that slot out, so nothing writes it as a row.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.host.region import PAGE, HostRegion

WORD_BYTES = 8


@dataclass(frozen=True)
class HostRows:
    """A new host region: `num_slots` rows from its start, then their generations at `offset`."""

    region: HostRegion
    num_slots: int
    offset: int
    generations: memoryview


def create_region(cpu_bytes: int, row_bytes: int, shm_dir: str) -> HostRows:
    """A host region (`HostRegion.create`, guarded) for `cpu_bytes` of rows of `row_bytes`, rounded
    up to whole pages, with the generations of its slots after the rows."""
    offset = -(-cpu_bytes // PAGE) * PAGE
    num_slots = offset // row_bytes
    region = HostRegion.create(offset + nbytes(num_slots), shm_dir=shm_dir, min_bytes=row_bytes,
                               guard=True)
    try:
        return HostRows(region, num_slots, offset, view(region.buf, offset, num_slots))
    except BaseException:
        region.close()
        raise


def nbytes(num_slots: int) -> int:
    """Bytes of the generations of `num_slots` slots."""
    return WORD_BYTES * num_slots


def view(buf: memoryview, offset: int, num_slots: int) -> memoryview:
    """The `num_slots` generations stored at `buf[offset:]`, as a writable uint64 memoryview.
    Raises ValueError when `offset` is not 8-byte aligned or `buf` is too short."""
    if offset % WORD_BYTES or offset + nbytes(num_slots) > len(buf):
        raise ValueError(f"no {num_slots} slot generations at offset {offset} of {len(buf)} bytes")
    return buf[offset : offset + nbytes(num_slots)].cast("Q")
