"""Question (3), chunk size: the prompt tokens each chunk size reuses, whole chunks and unfull ones,
as the engine stores and finds them, and the `chunk_tokens` the plan recommends.

The trace's unit is its recorded chunk (one engine block in a trace recorded with
`blocks_per_chunk` 1, the granularity to plan chunk sizes from). A chunk of `f` units is named by
its last unit's key: keys chain over the whole prefix, so equal keys are equal prefixes of equal
length. A record stores its prompt's and its reply's units (`keys`, then `dkeys`: the engine stores
decode chunks too). Per chunk size, request by request (`kvtier.engine.planner`,
`kvtier.engine.unfull`):

- whole chunks: the leading run of its prompt's chunks an earlier record stored, within the
  chunks a lookup may offer (never the last prompt token: `(prompt - 1) // chunk_tokens` chunks);
- unfull chunk: where that run ends, the most units `b` (0 < b < f) past it that an earlier
  request ended with, stored when it finished: a request ends at its last stored unit (prompt and
  reply), and a request whose end is `b` units into a chunk stores those `b` units under their own
  key when it finishes. A later lookup tries that chunk's `b` from the most down, within its
  prompt but its last token, and loads the first one stored: only an end at exactly `b` units
  with the same tokens (the same key at that unit) matches, and only of a request that finished
  before this one arrived.

An end key seen by the lookup is a prefix seen before, so the `b` found is the last unit `j` below
`top` (the run of seen prompt units, cut at what a lookup may offer) that is the end of a request
finished by then; it is past the whole run of chunk size `f` when `j >= f * (top // f)`. One pass
over the last units below `top` answers every size: the table costs a few vectorized passes over
the references, then a few over the records per size. Exact for a trace of one block per unit; a
coarser trace knows ends in whole units only. kv-events records (stored batches, no prompt) count
their seen chunks as before: no lookup limit, no unfull chunk.

Bytes: a stored whole chunk and a load move `f` units; an unfull chunk's store fills a whole host
row (`f` units) and its load moves its `b` units. `recommend_chunk_tokens` picks the largest size
whose reused tokens are at least `KEPT` (99%) of the smallest size's and whose bytes fit the host
transfer budget: a larger chunk is fewer objects, keys and lookups per token in every tier, so the
largest that gives up no reuse and no transfer budget is the one to run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.trace.analysis import Stream
from kvtier.trace.records import Trace

BLOCKS_PER_CHUNK = (1, 2, 4, 8, 16, 32)
KEPT = 0.99


def _decode_seen(trace: Trace, record: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Whether each prompt reference at `positions` repeats a unit an earlier record's reply stored."""
    drefs = trace.decode_refs
    if len(drefs) == 0 or len(positions) == 0:
        return np.zeros(len(positions), dtype=bool)
    drecord = np.repeat(np.arange(trace.records, dtype=np.int64), trace.decode_counts)
    keys, first = np.unique(drefs, return_index=True)  # in record order: first is the earliest
    at = np.minimum(np.searchsorted(keys, trace.refs[positions]), len(keys) - 1)
    found: np.ndarray = (keys[at] == trace.refs[positions]) & (drecord[first[at]] < record[positions])
    return found


def _seen(stream: Stream) -> np.ndarray:
    """Per prompt reference: its unit was stored by an earlier record (prompt or reply)."""
    seen = stream.reuse.copy()
    unseen = np.flatnonzero(~seen)
    seen[unseen] = _decode_seen(stream.trace, stream.record, unseen)
    return seen


def _leading(stream: Stream, seen: np.ndarray) -> np.ndarray:
    """Per record, the units of its leading run of seen prompt references."""
    trace = stream.trace
    lead = trace.counts.copy()
    unseen = np.flatnonzero(~seen)
    rec = stream.record[unseen]
    first = np.flatnonzero(np.diff(rec, prepend=-1))  # the first unseen reference of each record
    lead[rec[first]] = unseen[first] - trace.starts[rec[first]]
    return lead


def _ends(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The end keys of the request records (their last stored unit, reply included), sorted and
    distinct, each with the earliest time a request ending there finished."""
    dends = np.cumsum(trace.decode_counts)
    replied = np.flatnonzero((trace.prompt > 0) & (trace.decode_counts > 0))
    prompted = np.flatnonzero((trace.prompt > 0) & (trace.decode_counts == 0) & (trace.counts > 0))
    last = np.concatenate((trace.decode_refs[dends[replied] - 1],
                           trace.refs[trace.starts[prompted] + trace.counts[prompted] - 1]))
    rows = np.concatenate((replied, prompted))
    finished = trace.t[rows] + trace.finish[rows]
    order = np.lexsort((finished, last))
    last, finished = last[order], finished[order]
    head = np.concatenate(([True], last[1:] != last[:-1])) if len(last) else np.zeros(0, dtype=bool)
    return last[head], finished[head]


def _last_end(stream: Stream, top: np.ndarray, width: int) -> np.ndarray:
    """Per record, the last unit j in [top - width, top) that ends a request finished before the
    record arrived (-1: none)."""
    trace = stream.trace
    keys, finished = _ends(trace)
    found = np.full(trace.records, -1, dtype=np.int64)
    if len(keys) == 0:
        return found
    for k in range(1, width + 1):
        rows = np.flatnonzero((found < 0) & (top >= k))
        if len(rows) == 0:
            break
        ref = trace.refs[trace.starts[rows] + top[rows] - k]
        at = np.minimum(np.searchsorted(keys, ref), len(keys) - 1)
        hit = (keys[at] == ref) & (finished[at] < trace.t[rows])
        found[rows[hit]] = top[rows[hit]] - k
    return found


def _events_reused(stream: Stream, seen: np.ndarray, local: np.ndarray, f: int) -> int:
    """Seen chunks of `f` units of the records that are no requests (kv-events batches)."""
    mask = (stream.trace.prompt[stream.record] == 0) & ((local + 1) % f == 0)
    return int((seen & mask).sum())


def chunk_sizes(stream: Stream, chunk_bytes: int, host_bytes_per_s: float) -> list[dict[str, Any]]:
    """One row per chunk size of `BLOCKS_PER_CHUNK` (engine blocks) the trace's granularity allows
    (the recorded chunk alone when none does)."""
    trace = stream.trace
    header = trace.header
    duration = float(trace.t[-1] - trace.t[0])
    k = header.blocks_per_chunk
    sizes = [b // k for b in BLOCKS_PER_CHUNK if b % k == 0] or [1]  # at least the recorded chunk
    requests = trace.prompt > 0
    seen = _seen(stream)
    limit = np.where(requests, np.minimum(trace.counts, (trace.prompt - 1) // header.chunk_tokens), 0)
    top = np.minimum(_leading(stream, seen), limit)
    end = _last_end(stream, top, max(sizes) - 1)
    units = trace.counts + trace.decode_counts
    local = np.arange(len(trace.refs), dtype=np.int64) - trace.starts[stream.record]
    once = local[stream.key_refs[stream.key_of] == 1]
    events = not requests.all()
    rows = []
    for f in sizes:
        whole = top // f
        base = whole * f
        unfull = np.where(end >= base, end - base + 1, 0)
        reused = int(whole.sum()) + (_events_reused(stream, seen, local, f) if events else 0)
        unfull_units = int(unfull.sum())
        size = f * chunk_bytes
        stored = (int((units // f).sum()) - reused + int((requests & (units % f > 0)).sum())) * size
        loaded = reused * size + unfull_units * chunk_bytes
        reused_tokens = (reused * f + unfull_units) * header.chunk_tokens
        moved = stored + loaded
        rows.append({
            "blocks_per_chunk": f * header.blocks_per_chunk,
            "chunk_tokens": f * header.chunk_tokens,
            "chunk_bytes": size,
            "reused_tokens": reused_tokens,
            "unfull_tokens": unfull_units * header.chunk_tokens,
            "bytes_moved": moved,
            "bytes_per_reused_token": moved / reused_tokens if reused_tokens else None,
            "unneeded_bytes": int(((once + 1) % f == 0).sum()) * size,
            "load_ms_per_chunk": 1000.0 * size / host_bytes_per_s,
            "host_budget_fraction": moved / duration / host_bytes_per_s if duration > 0 else None,
        })
    return rows


def recommend_chunk_tokens(rows: list[dict[str, Any]]) -> int:
    """The largest chunk (tokens) reusing at least `KEPT` of the smallest's tokens within the host
    transfer budget (the smallest when none does)."""
    best = rows[0]
    for row in rows[1:]:
        within = row["host_budget_fraction"] is None or row["host_budget_fraction"] <= 1.0
        if within and row["reused_tokens"] >= KEPT * rows[0]["reused_tokens"]:
            best = row
    return int(best["chunk_tokens"])
