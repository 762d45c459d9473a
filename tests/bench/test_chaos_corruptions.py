"""Every corruption the chaos campaign injects makes a stored chunk fail kvtier's verification
(`chunkfmt.verify`), whatever byte or bit it picks: none can come back as a valid chunk."""

from __future__ import annotations

import os
import random

import pytest

from kvtier.bench.chaos.corrupt import CORRUPTIONS
from kvtier.tiers.common import chunkfmt

ROW = 3 * 4096
FP = chunkfmt.fingerprint_bytes("00112233445566778899aabbccddeeff")


def _stored(key: bytes) -> bytes:
    row = os.urandom(ROW)
    return chunkfmt.header_bytes(key, FP, row) + row


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_every_corruption_fails_verification(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(200):
        key, other_key = os.urandom(32), os.urandom(32)
        data, other = _stored(key), _stored(other_key)
        assert chunkfmt.verify(data[:4096], data[4096:], key, FP) is None
        bad = CORRUPTIONS[kind](data, other, rng)
        assert chunkfmt.verify(bad[:4096], bad[4096:], key, FP) is not None, kind

