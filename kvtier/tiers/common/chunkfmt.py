"""The stored form of one chunk, shared by every tier that keeps bytes outside the host region.

A stored chunk is a fixed 4 KiB header followed by the host row (the payload). The header holds a
magic, the format version, the chunk key, the layout fingerprint, the payload length and an
xxh3-128 checksum of the payload. A reader verifies all of them before the payload is used; any
mismatch makes the copy bad (a miss, to be removed by the caller). Nothing is deserialized beyond
these fixed-width fields.

The header is 4 KiB so that the payload starts on a page boundary: files can be read and written
with O_DIRECT straight into page-aligned host-region rows.
"""

from __future__ import annotations

import struct

import xxhash

from kvtier.format.chunks import ChunkError

MAGIC = b"KVTCHUNK"
VERSION = 1
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sHHI32s16sQ16s")
"""magic, version, flags, header length, key, layout fingerprint, payload length, checksum."""


def checksum(payload: memoryview | bytes) -> bytes:
    """The 16-byte xxh3-128 digest stored in the header."""
    return xxhash.xxh3_128_digest(payload)


def fingerprint_bytes(layout_fingerprint: str) -> bytes:
    """The 16 raw bytes of a layout fingerprint given as 32 hex digits."""
    raw = bytes.fromhex(layout_fingerprint)
    if len(raw) != 16:
        raise ValueError(f"layout fingerprint must be 32 hex digits, got {layout_fingerprint!r}")
    return raw


def pack_header(
    out: memoryview | bytearray, key: bytes, layout_fp: bytes, payload: memoryview | bytes
) -> None:
    """Write the header of `payload` into the first HEADER_BYTES of `out` (zero padded)."""
    pack_header_digest(out, key, layout_fp, len(payload), checksum(payload))


def pack_header_digest(
    out: memoryview | bytearray, key: bytes, layout_fp: bytes, payload_len: int, digest: bytes
) -> None:
    """`pack_header` for a payload whose checksum `digest` is already known."""
    _FIXED.pack_into(out, 0, MAGIC, VERSION, 0, HEADER_BYTES, key, layout_fp, payload_len, digest)
    out[_FIXED.size : HEADER_BYTES] = bytes(HEADER_BYTES - _FIXED.size)


def header_bytes(key: bytes, layout_fp: bytes, payload: memoryview | bytes) -> bytes:
    """A fresh header for `payload`."""
    buf = bytearray(HEADER_BYTES)
    pack_header(buf, key, layout_fp, payload)
    return bytes(buf)


def check_header(
    header: memoryview | bytes, key: bytes | None, layout_fp: bytes | None, payload_len: int | None
) -> tuple[ChunkError | None, bytes]:
    """Verify a header against what the reader expects (None: accept any value).

    Returns (None, expected checksum) when the header is acceptable, else (reason, b"").
    """
    if len(header) < HEADER_BYTES:
        return ChunkError.SHORT, b""
    magic, version, flags, hlen, hkey, hfp, plen, digest = _FIXED.unpack_from(header, 0)
    if magic != MAGIC:
        return ChunkError.MAGIC, b""
    if version != VERSION or flags != 0 or hlen != HEADER_BYTES:
        return ChunkError.VERSION, b""
    if key is not None and hkey != key:
        return ChunkError.KEY, b""
    if layout_fp is not None and hfp != layout_fp:
        return ChunkError.LAYOUT, b""
    if payload_len is not None and plen != payload_len:
        return ChunkError.LENGTH, b""
    return None, bytes(digest)


def header_fields(header: memoryview | bytes) -> tuple[bytes, bytes, int]:
    """(key, layout fingerprint, payload length) of a header that passed `check_header`."""
    _m, _v, _f, _h, hkey, hfp, plen, _d = _FIXED.unpack_from(header, 0)
    return bytes(hkey), bytes(hfp), int(plen)


def verify(
    header: memoryview | bytes,
    payload: memoryview | bytes,
    key: bytes | None,
    layout_fp: bytes | None,
) -> ChunkError | None:
    """Full verification of a stored chunk: header fields, payload length, then checksum."""
    err, digest = check_header(header, key, layout_fp, len(payload))
    if err is not None:
        return err
    if checksum(payload) != digest:
        return ChunkError.CHECKSUM
    return None
