"""The operator guide's four questions, answered from a trace's chunk reference stream.

A reference is one chunk key of one record, at the record's time `t` (a request's arrival, or the
time the engine stored the batch); records are taken in time order. A reference whose key appeared
in an earlier reference is a reuse; the key's first reference is its creation. Everything here is
vectorized numpy over the references (a few sorts), so memory is a few arrays of the stream's length.

- (0) context length: the prompt tokens per request, p50/p95/p99 (the guide's baseline asks for it).
- (1) shared prefixes: `reusable_token_fraction` is the reused references' tokens over the prompt
  tokens; a record's shared prefix ends at its last reused key; prefixes are ranked by the tokens
  their reuses would save.
- (2) reuse time: creation → each reuse, and previous reference → reuse (the gap between reuses).
- (3) chunk size: `chunk_sizes.py` (whole chunks and unfull ones, as the engine finds them).
- (4) bypass: keys referenced once, and what an admission gate that refuses chunks keeps of the
  reuse: `priority` (`min_retention_priority` applied to the creating request's priority), and
  `frequency` at a secondary tier's gate (a chunk is cascaded once seen in `min_seen` requests, so
  the reuses after its `min_seen`-th sighting are kept). At the host `frequency` refuses nothing
  but keeps chunks on probation: `probation.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.trace.mrc import previous_reference
from kvtier.trace.records import Trace

TOP_PREFIXES = 10
MIN_SEEN = (1, 2, 3, 4)


@dataclass
class Stream:
    """The reference stream of a trace, with the per-reference facts every question needs."""

    trace: Trace
    record: np.ndarray
    """Record index of each reference."""
    prev: np.ndarray
    """Index of the previous reference to the same key (-1: first)."""
    key_refs: np.ndarray
    """References per distinct key."""
    key_first: np.ndarray
    """Index of each distinct key's first reference."""
    key_of: np.ndarray
    """Distinct-key index of each reference."""

    @classmethod
    def of(cls, trace: Trace) -> Stream:
        refs = trace.refs
        record = np.repeat(np.arange(trace.records, dtype=np.int64), trace.counts)
        _, first, key_of, counts = np.unique(
            refs, return_index=True, return_inverse=True, return_counts=True
        )
        return cls(trace, record, previous_reference(refs), counts, first, key_of)

    @property
    def reuse(self) -> np.ndarray:
        return self.prev >= 0


def _percentiles(values: np.ndarray) -> dict[str, float | None]:
    if len(values) == 0:
        return {"p50": None, "p95": None, "p99": None}
    p = np.percentile(values, [50, 95, 99])
    return {"p50": float(p[0]), "p95": float(p[1]), "p99": float(p[2])}


def _per_record_sum(stream: Stream, values: np.ndarray) -> np.ndarray:
    cs = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    starts, counts = stream.trace.starts, stream.trace.counts
    out: np.ndarray = cs[starts + counts] - cs[starts]
    return out


def prompt_tokens(trace: Trace) -> np.ndarray:
    """Prompt tokens per record: the recorded prompt length, else its chunks' tokens."""
    chunked = trace.counts * trace.header.chunk_tokens
    out: np.ndarray = np.where(trace.prompt > 0, trace.prompt, chunked)
    return out


def context_lengths(trace: Trace) -> dict[str, float | None]:
    """p50/p95/p99 of the prompt tokens per request (the records with a recorded prompt length;
    None each for a kv-events trace, whose records are stored batches, not requests)."""
    return _percentiles(trace.prompt[trace.prompt > 0])


def shared_prefixes(stream: Stream) -> dict[str, Any]:
    """Question (1)."""
    trace, ct = stream.trace, stream.trace.header.chunk_tokens
    reuse = stream.reuse
    reused = _per_record_sum(stream, reuse.astype(np.int64))
    tokens = int(prompt_tokens(trace).sum())
    # The shared prefix of a record ends at its last reused key.
    last = np.full(trace.records, -1, dtype=np.int64)
    positions = np.flatnonzero(reuse)
    np.maximum.at(last, stream.record[positions], positions)
    with_prefix = last >= 0
    ends = last[with_prefix]
    lengths = ends - trace.starts[with_prefix] + 1
    keys, inverse, users = np.unique(trace.refs[ends], return_inverse=True, return_counts=True)
    chunks = np.zeros(len(keys), dtype=np.int64)
    chunks[inverse] = lengths
    saved = users * chunks * ct
    top = np.argsort(-saved, kind="stable")[:TOP_PREFIXES]
    return {
        "reusable_token_fraction": float(reused.sum() * ct / tokens) if tokens else 0.0,
        "requests_with_shared_prefix_fraction": float(with_prefix.mean()),
        "top_shared_prefixes": [
            {"key": int(keys[i]).to_bytes(8, "big").hex(), "tokens": int(chunks[i] * ct),
             "reuses": int(users[i]), "saved_tokens": int(saved[i])}
            for i in top
        ],
    }


def reuse_times(stream: Stream) -> dict[str, Any]:
    """Question (2): seconds from a chunk's creation to each reuse, and between reuses."""
    t = stream.trace.t[stream.record]
    reuse = stream.reuse
    created = t[stream.key_first[stream.key_of]]
    since_creation = (t - created)[reuse]
    gaps = (t - t[np.maximum(stream.prev, 0)])[reuse]
    return {"reuse_time_s": _percentiles(since_creation), "reuse_gap_s": _percentiles(gaps),
            "reuse_time_samples": since_creation}


def bypass(stream: Stream) -> dict[str, Any]:
    """Question (4): never-reused chunks and the admission settings that drop them."""
    refs_per_key = stream.key_refs
    keys = len(refs_per_key)
    reuses = int((refs_per_key - 1).sum())
    frequency = []
    for m in MIN_SEEN:
        kept = int(np.maximum(refs_per_key - m, 0).sum())
        frequency.append({
            "min_seen": m,
            "admitted_chunk_fraction": float((refs_per_key >= m).mean()),
            "reuse_kept_fraction": kept / reuses if reuses else 1.0,
        })
    priority = []
    creator = stream.trace.priority[stream.record[stream.key_first]]
    for cut in np.unique(creator):
        admitted = creator >= cut
        kept = int((refs_per_key[admitted] - 1).sum())
        priority.append({
            "min_retention_priority": int(cut),
            "admitted_chunk_fraction": float(admitted.mean()),
            "reuse_kept_fraction": kept / reuses if reuses else 1.0,
        })
    return {
        "never_reused_chunk_fraction": float((refs_per_key == 1).sum() / keys) if keys else 0.0,
        "admission": {"frequency": frequency, "priority": priority},
    }
