"""What every part of kvtier says about chunks: their key type, the events that announce where
they live, why a stored copy is rejected, and the names of the places a prompt token's KV comes
from.

This module imports nothing from kvtier, so the host tier, the secondary tiers, the manager and the
engine integrations all share one vocabulary without importing each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ChunkKey = bytes
"""A chunk key: the raw digest from `kvtier.format.keys` (32 bytes)."""

DEVICE = "device"
"""Token source: the engine's own prefix cache already held the KV."""
HOST = "host"
"""Token source and tier name of the host (primary) tier."""
RECOMPUTED = "recomputed"
"""Token source: no tier could serve the KV; the engine computed it."""


class TierEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class TierEvent:
    """Chunks became available in (STORED) or vanished from (REMOVED) a tier."""

    kind: TierEventKind
    keys: tuple[ChunkKey, ...]


class ChunkError(enum.Enum):
    """Why a stored chunk was rejected. The value is the `reason` label of the `bad_chunks` metric
    and what fsck prints."""

    SHORT = "short"
    MAGIC = "foreign_format"
    VERSION = "version"
    KEY = "wrong_key"
    LAYOUT = "wrong_layout"
    LENGTH = "wrong_length"
    CHECKSUM = "checksum"
    MAC = "mac"
    """The fleet key's MAC does not hold (a chunk written without the key or with another one, or
    forged), or a chunk MACed with a fleet key reached a reader that has none."""
