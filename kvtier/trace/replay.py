"""The host tier's hit ratio behind the engine's own prefix cache, by replaying a connector trace.

A miss-ratio curve treats every chunk reference as a host lookup. Behind a device prefix cache the
host tier sees something else, and kvtier's host tier (`kvtier.host.tier`) does this with it,
which the replay copies per request:

- at its lookup (arrival + `lookup`: the lookup its blocks were allocated on), the request's
  leading `src.device` tokens came from the device: their chunks are not looked up (nor refreshed)
  in the host tier; past them the host is asked chunk by chunk until the first chunk it lacks (a
  lookup is a prefix): each found chunk is a host hit and becomes most recently used;
- when its prefill ends (arrival + `ttft`), every prompt chunk the host lacks is stored (the engine
  computed it, or the device held it) as most recently used, evicting the least recently used;
  chunks it holds are left in place; then the chunks its decode filled (`dkeys`) likewise.

Lookups and stores of all requests are replayed in time order (a lookup first at equal times), so
requests that run together look up before each other's stores, as they do in the engine. The device
hits are taken as recorded: the replay assumes they do not depend on the host size (the device
cache is the same whatever the host holds). Cost: O(references) per size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.trace.format import Trace

LOOKUP, STORE = 0, 1


def host_hit_ratios(trace: Trace, sizes: Sequence[int]) -> list[float]:
    """Host hits over chunk references for an LRU host tier of each size (chunks)."""
    refs = trace.refs.tolist()
    starts, counts = trace.starts.tolist(), trace.counts.tolist()
    device = (trace.device // trace.header.chunk_tokens).tolist()
    decoded = trace.decode_refs.tolist()
    dcounts = trace.decode_counts.tolist()
    dstarts = np.concatenate(([0], np.cumsum(trace.decode_counts)[:-1])).tolist()
    n = trace.records
    times = np.concatenate([trace.t + trace.lookup, trace.t + np.maximum(trace.ttft, trace.lookup)])
    kinds = np.repeat([LOOKUP, STORE], n)
    order = np.lexsort((kinds, times))
    events = [(int(kinds[i]), int(i % n)) for i in order]
    out = []
    for size in sizes:
        hits = 0
        cache: OrderedDict[int, None] = OrderedDict()
        for kind, r in events:
            keys = refs[starts[r] : starts[r] + counts[r]]
            if kind == LOOKUP:
                for key in keys[device[r]:]:
                    if key not in cache:
                        break
                    hits += 1
                    cache.move_to_end(key)
                continue
            keys = keys + decoded[dstarts[r] : dstarts[r] + dcounts[r]]
            for key in keys if size > 0 else ():
                if key not in cache:
                    if len(cache) >= size:
                        cache.popitem(last=False)
                    cache[key] = None
        out.append(hits / len(refs) if refs else 0.0)
    return out
