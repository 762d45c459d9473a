"""The host tier's hit ratio behind the engine's own prefix cache, by replaying a connector trace.

A miss-ratio curve treats every chunk reference as a host lookup. Behind a device prefix cache the
host tier sees something else, and kvtier's host tier (`kvtier.host.tier`) does this with it,
which the replay copies per request:

- at its lookup (arrival + `lookup`: the lookup its blocks were allocated on), the request's
  leading `src.device` tokens came from the device: their chunks are not looked up in the host
  tier; past them the host is asked chunk by chunk until the first chunk it lacks (a lookup is a
  prefix): each found chunk is a host hit and is pinned (not evictable) while it is copied to the
  device: a load from the host alone until the end of its lookup's step (`schedule_s` after the
  lookup, past that step's stores: the copy runs in that step), others until the request's next
  step that completes chunks; a lookup or a load changes no recency;
- at each step that completes chunks of the request (`st`: the prompt's chunks as the prefill
  computes them, then those decode fills), every completed chunk the host lacks gets a row as
  most recently used (a chunk ranks from its allocation), evicting the least recently used chunk
  that is neither pinned nor named by that step (the engine reserves the rows when it schedules
  the step and publishes them once the step's forward pass is over, before any later lookup: so
  nothing looks them up in between);
- when it finishes (`end`), every chunk of the request the host holds (device hits included)
  becomes the most recently used, its last chunk first and its first chunk last
  (`HostTier.used_prefix`).

The replay's own hits move a request's first step where the trace says how: a request that loads
nothing is scheduled on the step of its lookup (its prefill does not wait for a copy), so when the
trace recorded a load from the host alone (`src.host` and no other tier) and the replay finds no
host chunk for it, its first step is taken `schedule_s` after its lookup, not at the recorded time
(which waited for that load). `schedule_s` is the longest time the trace records from a lookup to
the step of a request that loaded nothing (the rest of that scheduler step's lookups come before
its stores); a trace without such a record (or without `st`) moves nothing. The converse (the
replay finds host chunks where the trace recorded none, so the prefill would wait for a load of
unrecorded length) keeps the recorded step.

Lookups, steps and ends of all requests are replayed in time order (a pin's release, then a
lookup, then a step, then an end at equal times, as the engine's scheduler runs them); a request
whose next step is recorded at or before its lookup (a trace without timings) pins nothing. A
request ends as recorded, even when its first step moved (a trace without `end`: at its last
step). Traces recorded before `st`
existed read as one step at the first token completing every chunk. The device hits are taken as
recorded: the replay assumes they do not depend on the host size (the device cache is the same
whatever the host holds), and that requests arrive as recorded (a closed-loop client whose next
request waits for a slower recompute is not replayed). Cost: O(references) per size, plus the
pinned chunks skipped per eviction.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.trace.records import Trace

RELEASE, LOOKUP, STORE, FINISH = 0, 1, 2, 3
_AFTER = 1e-6
"""How long after the last store of a step its end comes, in the replay's order of events."""


def _events(trace: Trace, delay: float | None) -> list[tuple[float, int, int, int]]:
    """(time, kind, record, chunks complete for a STORE) in replay order. A load from the host
    alone is released at the end of its lookup's step (`delay` after the lookup: after that step's
    stores), or at the request's first step if that comes first."""
    events = []
    times = zip(trace.t.tolist(), trace.lookup.tolist(), trace.finish.tolist(), strict=True)
    host_only = _host_loads(trace).tolist()
    for r, (t, lookup, finish) in enumerate(times):
        events.append((t + lookup, LOOKUP, r, 0))
        events.append((t + finish, FINISH, r, 0))
        steps = trace.stores[r]
        release = t + (steps[0][0] if steps else lookup)
        if delay is not None and host_only[r]:
            release = min(release, t + lookup + delay + _AFTER)
        events.append((release, RELEASE, r, 0))
        events.extend((t + dt, STORE, r, n) for dt, n in steps)
    events.sort()
    return events


def _host_loads(trace: Trace) -> np.ndarray:
    """Per record, whether it was recorded loading from the host tier and from no other tier."""
    loads: np.ndarray = (trace.host > 0) & (trace.beyond == 0)
    return loads


def schedule_s(trace: Trace) -> float | None:
    """The longest recorded time from a lookup to the first step of a request that loaded nothing
    (None: no such record with steps)."""
    quiet = trace.stepped & (trace.host == 0) & (trace.beyond == 0)
    delays = [trace.stores[r][0][0] - trace.lookup[r] for r in np.flatnonzero(quiet).tolist()
              if trace.stores[r]]
    return max(0.0, *delays) if delays else None


def host_hit_ratios(trace: Trace, sizes: Sequence[int]) -> list[float]:
    """Host hits over chunk references for an LRU host tier of each size (chunks)."""
    refs = len(trace.refs)
    return [sum(hits) / refs if refs else 0.0 for hits in host_hits(trace, sizes)]


def host_hits(trace: Trace, sizes: Sequence[int]) -> list[list[int]]:
    """Per size (chunks of an LRU host tier), the chunks it serves each record."""
    refs = trace.refs.tolist()
    starts, counts = trace.starts.tolist(), trace.counts.tolist()
    decoded = trace.decode_refs.tolist()
    dstarts = np.concatenate(([0], np.cumsum(trace.decode_counts)[:-1])).tolist()
    dcounts = trace.decode_counts.tolist()
    chunks = [refs[starts[r] : starts[r] + counts[r]] + decoded[dstarts[r] : dstarts[r] + dcounts[r]]
              for r in range(trace.records)]
    delay = schedule_s(trace)
    events = _events(trace, delay)
    movable = (_host_loads(trace) & trace.stepped).tolist()
    moves = [trace.stores[r][0][1] if delay is not None and movable[r] and trace.stores[r] else None
             for r in range(trace.records)]
    return [_replay(trace, chunks, events, moves, delay or 0.0, size) for size in sizes]


def _replay(trace: Trace, chunks: list[list[int]], events: list[tuple[float, int, int, int]],
            moves: list[int | None], delay: float, size: int) -> list[int]:
    """The chunks a host tier of `size` serves each record. `moves[r]`: the chunks record r's
    first step completes, when that step is taken `delay` after a lookup that finds nothing (None:
    the recorded step is kept)."""
    counts = trace.counts.tolist()
    device = (trace.device // trace.header.chunk_tokens).tolist()
    hits = [0] * trace.records
    cache: OrderedDict[int, None] = OrderedDict()
    pins: Counter[int] = Counter()
    held: dict[int, list[int]] = {}
    released = [False] * trace.records
    done = [0] * trace.records
    queue = list(events)  # sorted: a heap already
    while queue:
        at, kind, r, n = heapq.heappop(queue)
        if kind == RELEASE:
            released[r] = True
            pins.subtract(held.pop(r, ()))
            continue
        if kind == LOOKUP:
            found = []
            for key in chunks[r][device[r] : counts[r]]:
                if key not in cache:
                    break
                found.append(key)
            hits[r] = len(found)
            if not released[r]:
                pins.update(found)
                held[r] = found
            first = moves[r]
            if first is not None and not found:
                heapq.heappush(queue, (at + delay, STORE, r, first))
            continue
        if kind == FINISH:
            for key in reversed(chunks[r]):
                if key in cache:
                    cache.move_to_end(key)
            continue
        step = chunks[r][done[r] : n]
        done[r] = max(done[r], n)
        for key in step if size > 0 else ():
            if key in cache:
                continue
            if len(cache) >= size and not _evict(cache, pins, step):
                break
            cache[key] = None
    return hits


def _evict(cache: OrderedDict[int, None], pins: Counter[int], named: Sequence[int]) -> bool:
    """Drop the least recently used chunk that is neither pinned nor in `named`; False if none."""
    for key in cache:
        if pins[key] <= 0 and key not in named:
            del cache[key]
            return True
    return False
