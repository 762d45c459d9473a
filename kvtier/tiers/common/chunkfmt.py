"""The stored form of one chunk, shared by every tier that keeps bytes outside the host region.

A stored chunk is a fixed 4 KiB header followed by the host row (the payload). The header holds a
magic, the format version, flags, the chunk key, the layout fingerprint, the payload length and a
16-byte digest. Without a fleet key the flags are 0 and the digest is the xxh3-128 checksum of the
payload. With one (`fleetkey.FleetKey`) the flags are FLAG_MAC and the digest is the key's MAC of
the header's fields (magic to payload length) then the payload, so a chunk written by anyone
without the key, or with another key, fails to verify. A reader verifies everything before the
payload is used; any mismatch makes the copy bad (a miss, to be removed by the caller), and a
reader refuses a chunk whose flags are not its own (`ChunkError.MAC`): a keyed reader an unkeyed
chunk, an unkeyed reader a keyed one. Nothing is deserialized beyond these fixed-width fields.

The header is 4 KiB so that the payload starts on a page boundary: files can be read and written
with O_DIRECT straight into page-aligned host-region rows.
"""

from __future__ import annotations

import hmac
import struct

import xxhash

from kvtier.format.chunks import ChunkError
from kvtier.tiers.common.fleetkey import ChunkMac, FleetKey

MAGIC = b"KVTCHUNK"
VERSION = 1
HEADER_BYTES = 4096
FLAG_MAC = 1
"""The digest is the fleet key's MAC of the header's fields and the payload."""
_FIELDS = struct.Struct("<8sHHI32s16sQ")
"""magic, version, flags, header length, key, layout fingerprint, payload length: what a MAC covers
before the payload."""
_FIXED = struct.Struct("<8sHHI32s16sQ16s")
"""The fields, then the digest."""

Digest = xxhash.xxh3_128 | ChunkMac
"""A streaming digest of a payload (`payload_digest`)."""
Buffer = memoryview | bytes | bytearray


def checksum(payload: Buffer) -> bytes:
    """The 16-byte xxh3-128 digest an unkeyed header holds."""
    return xxhash.xxh3_128_digest(payload)


def fingerprint_bytes(layout_fingerprint: str) -> bytes:
    """The 16 raw bytes of a layout fingerprint given as 32 hex digits."""
    raw = bytes.fromhex(layout_fingerprint)
    if len(raw) != 16:
        raise ValueError(f"layout fingerprint must be 32 hex digits, got {layout_fingerprint!r}")
    return raw


def _flags(fleet: FleetKey | None) -> int:
    return 0 if fleet is None else FLAG_MAC


def digest_of(key: bytes, layout_fp: bytes, payload: Buffer, fleet: FleetKey | None = None) -> bytes:
    """The digest a header of `payload` holds: its checksum, or with `fleet` its MAC."""
    if fleet is None:
        return checksum(payload)
    mac = fleet.mac()
    mac.update(_FIELDS.pack(MAGIC, VERSION, FLAG_MAC, HEADER_BYTES, key, layout_fp, len(payload)))
    mac.update(payload)
    return mac.digest()


def pack_header(
    out: memoryview | bytearray, key: bytes, layout_fp: bytes, payload: Buffer,
    fleet: FleetKey | None = None,
) -> None:
    """Write the header of `payload` into the first HEADER_BYTES of `out` (zero padded); with
    `fleet`, a MACed one."""
    pack_header_digest(out, key, layout_fp, len(payload), digest_of(key, layout_fp, payload, fleet),
                       fleet)


def pack_header_digest(
    out: memoryview | bytearray, key: bytes, layout_fp: bytes, payload_len: int, digest: bytes,
    fleet: FleetKey | None = None,
) -> None:
    """`pack_header` for a payload whose `digest_of` (under the same `fleet`) is already known."""
    _FIXED.pack_into(out, 0, MAGIC, VERSION, _flags(fleet), HEADER_BYTES, key, layout_fp,
                     payload_len, digest)
    out[_FIXED.size : HEADER_BYTES] = bytes(HEADER_BYTES - _FIXED.size)


def header_bytes(key: bytes, layout_fp: bytes, payload: Buffer, fleet: FleetKey | None = None) -> bytes:
    """A fresh header for `payload`."""
    buf = bytearray(HEADER_BYTES)
    pack_header(buf, key, layout_fp, payload, fleet)
    return bytes(buf)


def check_header(
    header: Buffer, key: bytes | None, layout_fp: bytes | None, payload_len: int | None,
    fleet: FleetKey | None = None,
) -> tuple[ChunkError | None, bytes]:
    """Verify a header against what the reader expects (None: accept any value), and that it is
    MACed exactly when the reader has a fleet key.

    Returns (None, expected digest) when the header is acceptable, else (reason, b"").
    """
    if len(header) < HEADER_BYTES:
        return ChunkError.SHORT, b""
    magic, version, flags, hlen, hkey, hfp, plen, digest = _FIXED.unpack_from(header, 0)
    if magic != MAGIC:
        return ChunkError.MAGIC, b""
    if version != VERSION or flags not in (0, FLAG_MAC) or hlen != HEADER_BYTES:
        return ChunkError.VERSION, b""
    if flags != _flags(fleet):
        return ChunkError.MAC, b""
    if key is not None and hkey != key:
        return ChunkError.KEY, b""
    if layout_fp is not None and hfp != layout_fp:
        return ChunkError.LAYOUT, b""
    if payload_len is not None and plen != payload_len:
        return ChunkError.LENGTH, b""
    return None, bytes(digest)


def header_fields(header: Buffer) -> tuple[bytes, bytes, int]:
    """(key, layout fingerprint, payload length) of a header that passed `check_header`."""
    _m, _v, _f, _h, hkey, hfp, plen, _d = _FIXED.unpack_from(header, 0)
    return bytes(hkey), bytes(hfp), int(plen)


def payload_digest(header: Buffer, fleet: FleetKey | None = None) -> Digest:
    """A streaming digest for the payload of `header` (one that passed `check_header` with the same
    `fleet`): fed the payload in order, its `digest()` is what `check_digest` compares."""
    if fleet is None:
        return xxhash.xxh3_128()
    mac = fleet.mac()
    mac.update(bytes(header[: _FIELDS.size]))
    return mac


def check_digest(computed: bytes, expected: bytes, fleet: FleetKey | None = None) -> ChunkError | None:
    """None when a payload's `computed` digest is the header's `expected` one, else why not."""
    if fleet is None:
        return None if computed == expected else ChunkError.CHECKSUM
    return None if hmac.compare_digest(computed, expected) else ChunkError.MAC


def check_payload(
    header: Buffer, payload: Buffer, expected: bytes, fleet: FleetKey | None = None
) -> ChunkError | None:
    """None when `payload` matches the digest `expected` that `check_header` gave for `header`."""
    if fleet is None:
        return check_digest(checksum(payload), expected)
    digest = payload_digest(header, fleet)
    digest.update(payload)
    return check_digest(digest.digest(), expected, fleet)


def verify(
    header: Buffer, payload: Buffer, key: bytes | None, layout_fp: bytes | None,
    fleet: FleetKey | None = None,
) -> ChunkError | None:
    """Full verification of a stored chunk: header fields, payload length, then digest."""
    err, digest = check_header(header, key, layout_fp, len(payload), fleet)
    if err is not None:
        return err
    return check_payload(header, payload, digest, fleet)
