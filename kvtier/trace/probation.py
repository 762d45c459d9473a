"""The host tier under `frequency` admission, replayed over a trace's chunk references: probation
as `policies/admission.py` (`FrequencyAdmission`) and `host/tier.py` (`HostTier`) do it.

`frequency` refuses nothing at the host: when a request arrives it counts one sighting of each
chunk of its prompt, and the resident chunks it names settle (they leave probation as the most
recent settled chunks). A chunk the host lacks is stored SETTLED when seen in at least `min_seen`
requests (this one included), else on probation: WARM when the request's first chunk was seen
`min_seen` times (it continues a reused prefix), COLD otherwise (a one-off prompt). A full host
evicts COLD before WARM before SETTLED, the least recently used first within one retention (the
retention classes of `policies/classes.py`, LRU in each).

As for the miss-ratio curve (`mrc.py`), every chunk reference is a host lookup in record order: a
reference to a resident chunk is a hit, any other stores the chunk. So with `min_seen` 1 (every
chunk settled: `all`) a run is exactly the LRU curve at its size. Left out: the sketch's errors
(sightings are counted exactly, with no halving every `sample_size` sightings), priorities (one
class per retention; the `priority` rows of `analysis.bypass` cover them), and the engine's own
prefix cache in front (`replay.py` models that, for LRU). A long stream is sampled as
`mrc.simulate` samples it (the keys under rate R, the host scaled by R). A kv-events trace's
records are stored batches, not requests: a batch's first chunk stands for the request's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.policies.base import Retention
from kvtier.trace.analysis import Stream
from kvtier.trace.mrc import sample_rate, sampled


@dataclass(frozen=True)
class HostRun:
    """One host tier of `frequency` admission replayed over the (sampled) references."""

    min_seen: int
    references: int
    hits: int
    stored: int
    """Chunks the host stored (references that missed while it had room or could evict)."""
    on_probation: int
    """Of the stored chunks, those stored COLD or WARM."""
    holding_s: float | None
    """Median seconds from an evicted chunk's last use to its eviction (None: nothing evicted)."""

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.references if self.references else 0.0

    @property
    def probation_fraction(self) -> float:
        return self.on_probation / self.stored if self.stored else 0.0


def sightings(key_of: np.ndarray) -> np.ndarray:
    """For each reference (`key_of`: its distinct-key index), the references to its key up to and
    including it: the requests that named the chunk by then, once a chunk is named once a request."""
    order = np.argsort(key_of, kind="stable")
    grouped = key_of[order]
    first = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    sizes = np.diff(np.r_[first, len(grouped)])
    out = np.empty(len(key_of), dtype=np.int64)
    out[order] = np.arange(len(grouped)) - np.repeat(first, sizes) + 1
    return out


def host_runs(stream: Stream, size: int, min_seens: Sequence[int]) -> list[HostRun]:
    """A host tier of `size` chunks under `frequency` admission at each `min_seen`, in order."""
    trace = stream.trace
    seen = sightings(stream.key_of)
    lead = np.zeros(trace.records, dtype=np.int64)
    has = trace.counts > 0
    lead[has] = seen[trace.starts[has]]
    rate = sample_rate(trace.refs)
    keep = sampled(trace.refs, rate)
    record = stream.record[keep]
    columns = (trace.refs[keep].tolist(), trace.t[record].tolist(), seen[keep].tolist(),
               lead[record].tolist())
    capacity = round(size * rate)
    return [_run(*columns, capacity, m) for m in min_seens]


def _run(keys: list[int], times: list[float], seen: list[int], lead: list[int], capacity: int,
         min_seen: int) -> HostRun:
    """One host tier of `capacity` chunks over the references (key, time, sightings of the key,
    sightings of its request's first chunk)."""
    settled = Retention.SETTLED
    classes: tuple[OrderedDict[int, float], ...] = tuple(OrderedDict() for _ in Retention)
    where: dict[int, Retention] = {}
    hits = stored = waiting = 0
    held: list[float] = []
    for key, t, n, first in zip(keys, times, seen, lead, strict=True):
        retention = where.get(key)
        if retention is not None:
            hits += 1
            del classes[retention][key]
            classes[settled][key] = t
            where[key] = settled
            continue
        if capacity < 1:
            continue
        if len(where) >= capacity:
            victims = next(c for c in classes if c)
            victim, last = victims.popitem(last=False)
            del where[victim]
            held.append(t - last)
        if n >= min_seen:
            retention = settled
        else:
            retention = Retention.WARM if first >= min_seen else Retention.COLD
            waiting += 1
        classes[retention][key] = t
        where[key] = retention
        stored += 1
    holding = float(np.median(held)) if held else None
    return HostRun(min_seen, len(keys), hits, stored, waiting, holding)
