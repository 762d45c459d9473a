"""Helpers that write kvtier traces for tests: keys are small integers, one 8-byte key each."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvtier.trace.records import TraceHeader


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def write_trace(path: Path, records: Sequence[dict], block_size: int = 16, blocks_per_chunk: int = 1,
                chunk_bytes: int | None = 1000, source: str = "connector") -> Path:
    """Write a header and `records`, each {"t", "keys": [ints], "prompt", "prio", ...}."""
    header = TraceHeader(source, block_size, blocks_per_chunk, chunk_bytes)
    lines = [header.to_json()]
    for r in records:
        rec = dict(r)
        rec["keys"] = b"".join(key(k) for k in r["keys"]).hex()
        if "dkeys" in r:
            rec["dkeys"] = b"".join(key(k) for k in r["dkeys"]).hex()
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path
