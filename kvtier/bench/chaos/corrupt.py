"""The corruptions the campaign injects into stored chunks, each a pure function of the stored
bytes: what a failing disk, a torn write, a buggy writer or a stale deployment leaves behind.

- `header_flip`: one bit of the header's fixed fields (magic, version, key, layout fingerprint,
  payload length, checksum) flipped; the zero padding after them carries no meaning.
- `payload_flip`: one bit of the payload (the KV bytes) flipped.
- `truncate`: the copy cut short (header intact or not).
- `extend`: bytes appended after a valid copy.
- `swap`: another chunk's valid bytes stored under this key (its header names the other key).
- `stale_layout`: the header's layout fingerprint replaced by another model's, the checksum valid.

Every one of them must make kvtier's verification reject the copy; none may come back as a hit.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvtier.tiers.common import chunkfmt

_FIXED_BYTES = 88
"""Bytes of the header's fixed fields (`chunkfmt._FIXED`): magic .. checksum."""
_FP_OFFSET = 48
Corruptor = Callable[[bytes, bytes, random.Random], bytes]
"""(stored bytes, another chunk's stored bytes, rng) -> corrupted bytes."""


def _flip(data: bytes, lo: int, hi: int, rng: random.Random) -> bytes:
    out = bytearray(data)
    i = rng.randrange(lo, hi)
    out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def header_flip(data: bytes, other: bytes, rng: random.Random) -> bytes:
    return _flip(data, 0, _FIXED_BYTES, rng)


def payload_flip(data: bytes, other: bytes, rng: random.Random) -> bytes:
    return _flip(data, chunkfmt.HEADER_BYTES, len(data), rng)


def truncate(data: bytes, other: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(0, len(data))]


def extend(data: bytes, other: bytes, rng: random.Random) -> bytes:
    return data + bytes(rng.randrange(1, 4096) * [0x5A])


def swap(data: bytes, other: bytes, rng: random.Random) -> bytes:
    return other


def stale_layout(data: bytes, other: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    stale = bytes(rng.randrange(256) for _ in range(16))
    out[_FP_OFFSET:_FP_OFFSET + 16] = stale
    return bytes(out)


CORRUPTIONS: dict[str, Corruptor] = {
    "header_flip": header_flip, "payload_flip": payload_flip, "truncate": truncate,
    "extend": extend, "swap": swap, "stale_layout": stale_layout,
}

WRONG_SIZE = frozenset({"truncate", "extend"})
"""The kinds that change a copy's length: an fs tier's scan (at its start) removes those copies."""
