"""Miss-ratio curves of a chunk reference stream: exact for LRU, by miniature simulation for others.

LRU: Mattson's stack distances, computed exactly in O(N log N) with a Fenwick tree over reference
positions (a 1 marks the latest reference of each key; the distance of a reuse is the number of
distinct keys referenced since its previous reference, plus one). An LRU cache of `c` chunks hits
exactly the references whose distance is at most `c`. The loop is compiled with numba when numba
is importable and `KVTIER_NUMBA` is not "0" (10 million references in about a second); otherwise
it runs in Python (about 100 times slower; the answer is the same). Set `KVTIER_NUMBA=0` in a
process that will start a vLLM engine afterwards: vLLM 0.32's kernel rebinding scans every loaded
module and fails on an object llvmlite (numba's backend) leaves in one.

Other policies (ARC) are not stack algorithms: their curve is simulated at each size with the
policy kvtier runs (`kvtier.policies`), on a spatial sample of the keys when the stream is long
(SHARDS-style miniature simulation: keys whose hash falls under rate R, caches scaled by R).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.policies.base import EvictionPolicy

SAMPLE_REFS = 100_000
"""Miniature simulations keep about this many references."""
_HASH_SPACE = 1 << 24


def previous_reference(ids: np.ndarray) -> np.ndarray:
    """For each reference, the index of the previous reference to the same key, -1 for a first."""
    order = np.argsort(ids, kind="stable")
    prev = np.full(len(ids), -1, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _fenwick_distances(prev: Any, out: Any, tree: Any) -> None:
    """out[i] = LRU stack distance of reference i (0 for a first reference); `tree` has len(prev)+1
    zeros. Written for numba and for plain Python alike."""
    n = len(prev)
    for i in range(n):
        p = prev[i]
        if p >= 0:
            s = 0
            k = i
            while k > 0:
                s += tree[k]
                k -= k & -k
            k = p + 1
            while k > 0:
                s -= tree[k]
                k -= k & -k
            out[i] = s + 1
            k = p + 1
            while k <= n:
                tree[k] -= 1
                k += k & -k
        k = i + 1
        while k <= n:
            tree[k] += 1
            k += k & -k


@functools.cache
def _compiled() -> Callable[[Any, Any, Any], None] | None:
    if os.environ.get("KVTIER_NUMBA", "1") == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    fn: Callable[[Any, Any, Any], None] = numba.njit(cache=True)(_fenwick_distances)
    return fn


def stack_distances(prev: np.ndarray, compiled: bool = True) -> np.ndarray:
    """LRU stack distance of each reference (0: first reference, a miss at every size)."""
    fn = _compiled() if compiled else None
    if fn is not None:
        out = np.zeros(len(prev), dtype=np.int64)
        fn(prev.astype(np.int64), out, np.zeros(len(prev) + 1, dtype=np.int64))
        return out
    outl = [0] * len(prev)
    _fenwick_distances(prev.tolist(), outl, [0] * (len(prev) + 1))
    return np.asarray(outl, dtype=np.int64)


def lru_hit_ratios(distances: np.ndarray, sizes: Sequence[int]) -> list[float]:
    """Hit ratio of an LRU cache of each size (in chunks) over the stream."""
    n = len(distances)
    if n == 0:
        return [0.0 for _ in sizes]
    hist = np.bincount(distances[distances > 0], minlength=1)
    cum = np.cumsum(hist)
    return [float(cum[min(int(s), len(cum) - 1)]) / n if s > 0 else 0.0 for s in sizes]


def sample_rate(refs: np.ndarray, target: int = SAMPLE_REFS) -> float:
    """The spatial sampling rate that keeps about `target` references (1.0: no sampling)."""
    return 1.0 if len(refs) <= target else target / len(refs)


def sampled(refs: np.ndarray, rate: float) -> np.ndarray:
    """Indices of the references whose key falls in the spatial sample of `rate` (every reference
    at 1.0): a key is in it with all its references or with none."""
    if rate >= 1.0:
        return np.arange(len(refs))
    out: np.ndarray = np.flatnonzero((refs % _HASH_SPACE) < int(rate * _HASH_SPACE))
    return out


def simulate(
    policy: type[EvictionPolicy[Any]], refs: np.ndarray, sizes: Sequence[int], rate: float = 1.0
) -> list[float]:
    """Hit ratio of `policy` at each size (chunks) over the references, simulated on the keys
    sampled at `rate` with each cache scaled by it (exact when `rate` is 1)."""
    refs = refs[sampled(refs, rate)]
    keys = refs.astype(">u8").tobytes()
    stream = [keys[i : i + 8] for i in range(0, len(keys), 8)]
    out: list[float] = []
    for size in sizes:
        capacity = round(size * rate)
        if capacity < 1 or not stream:
            out.append(0.0)
            continue
        cache = policy(capacity)
        hits = 0
        for key in stream:
            if key in cache:
                hits += 1
                cache.touch(key)
                continue
            if len(cache) >= capacity:
                cache.evict(1, ())
            cache.insert(key, True)
        out.append(hits / len(stream))
    return out
