"""`kvtier plan`: a trace's answers to the four questions, the host tier's miss-ratio curves, and
the settings they recommend, as one JSON-ready dict.

`requests` counts request records (a kv-events trace has none: it counts its stored batches).

Sizing: the MRC is over the whole reference stream (every prompt chunk of every record), from 0
to the working set (every distinct chunk): LRU exactly from stack distances, ARC by simulation
(`mrc.py`). "Reachable reuse" is the hit ratio of an unbounded cache (every reuse hits); the size
capturing q of it is the smallest LRU cache whose hit ratio reaches q times that.

Observed and predicted: `observed_hit_ratio` is the trace's recorded token sources (device, host,
each tier, recomputed) over the chunk references' tokens; `predict` (sizes given with `--at`)
gives, per host size, the LRU hit ratio and the host tier's own hit ratio behind the recorded
device hits (`replay.py`: what kvtier's host tier would serve at that size).

Cliffs: the replay is exact for the recorded order of events, but the order itself moves with the
host size where a request's host hits at that size differ from those recorded (`changed_requests`):
one recomputed instead of loaded finishes later, and a closed-loop client sends its next request
later. So each prediction comes with the range of the replay over the sizes within one request's
chunks of it (`cliff_chunks`: the median chunks a request stores, prompt and decode; sampled at -1,
-1/2, 0, +1/2, +1 of it), and is marked `cliff` where requests changed and that range spans more
than `CLIFF` (5 points, the accuracy asked of a prediction): there, one request more or less in the
host decides the hit ratio, and the number is not a forecast; size away from the cliff.
`recommend.cpu_cliff` gives the range of the LRU curve around `cpu_bytes_to_use` the same way
(`cliff`: it spans more than `CLIFF`).

Recommendations: `cpu_bytes_to_use` captures 90% of the reachable reuse (at most `host_bytes`,
the host memory an operator can give, when given) and `max_bytes` (the secondary tier) 99%, each
with the hit ratio it buys; `chunk_tokens` is the largest chunk that keeps 99% of the smallest
chunk's reused tokens, unfull chunks counted, within the host transfer budget (`chunk_sizes.py`),
`blocks_per_chunk` the same chunk in engine blocks (configure one of the two);
`min_retention_priority` keeps at least 99% of the reuse while dropping the most chunks.
`frequency_min_seen` is the one the verdict names when it says "offload with admission" (the host
tier's probation at `cpu_bytes_to_use` serves the most with it, `probation.py`); otherwise the one
that keeps at least 90% of the reuse at a secondary tier's gate while dropping the most chunks.
Each `admission.frequency` row gives both: the secondary gate's `admitted_chunk_fraction` and
`reuse_kept_fraction`, and the host tier's `host_hit_ratio` and `probation_chunk_fraction` at
`cpu_bytes_to_use` (`min_seen` 1 is `all`).

Verdict (`verdict.py`): `verdict`, `verdict_reason` and `verdict_checks` come first in the report:
offload, offload with admission, or will not help, and why.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.policies.arc import ARCPolicy
from kvtier.trace import analysis
from kvtier.trace.chunk_sizes import chunk_sizes, recommend_chunk_tokens
from kvtier.trace.mrc import lru_hit_ratios, sample_rate, simulate, stack_distances
from kvtier.trace.probation import HostRun, host_runs
from kvtier.trace.records import Trace, TraceError
from kvtier.trace.replay import host_hits
from kvtier.trace.verdict import WITH_ADMISSION, Evidence, decide, prefill_tokens_per_s

LRU_POINTS = 64
ARC_POINTS = 16
CAPTURE = (0.90, 0.95, 0.99)
GIB = 1 << 30
CLIFF = 0.05


def measure_host_bytes_per_s(nbytes: int = 64 << 20, repeat: int = 3) -> float:
    """Host memory copy bandwidth (bytes/s), best of a few copies of `nbytes`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


def _sizes(working_set: int, points: int) -> list[int]:
    return sorted({round(working_set * i / points) for i in range(points + 1)})


def _capture(distances: np.ndarray, refs: int, fraction: float) -> int:
    """The smallest LRU size (chunks) whose hits reach `fraction` of the reachable reuse."""
    reuse = distances[distances > 0]
    if len(reuse) == 0:
        return 0
    cum = np.cumsum(np.bincount(reuse))
    return int(np.searchsorted(cum, fraction * len(reuse) - 1e-9))


def _pick_admission(rows: list[dict[str, Any]], key: str, keep: float) -> int:
    """The setting that drops the most chunks while keeping `keep` of the reuse."""
    ok = [r for r in rows if r["reuse_kept_fraction"] >= keep]
    return int(min(ok, key=lambda r: r["admitted_chunk_fraction"])[key]) if ok else int(rows[0][key])


@dataclass
class Plan:
    """A plan: the JSON report, and the reuse times (seconds) its CDF plot is drawn from."""

    report: dict[str, Any]
    reuse_times: np.ndarray


def _observed(trace: Trace) -> dict[str, float]:
    """The recorded token sources as fractions of the chunk references' tokens."""
    tokens = len(trace.refs) * trace.header.chunk_tokens
    return {k: v / tokens for k, v in trace.sources.items()} if tokens else {}


def cliff_chunks(trace: Trace) -> int:
    """One request's chunks: the median a record stores (prompt and decode), at least 1."""
    return max(1, int(np.median(trace.counts + trace.decode_counts)))


def _around(size: int, width: int) -> list[int]:
    """The sizes within `width` of `size` a cliff is looked for at (>= 0)."""
    return sorted({max(0, size + width * i // 2) for i in (-2, -1, 0, 1, 2)})


def _cliff(sizes: list[int], ratios: list[float], chunk_bytes: int) -> dict[str, Any]:
    lo, hi = min(ratios), max(ratios)
    return {"range_bytes": [sizes[0] * chunk_bytes, sizes[-1] * chunk_bytes],
            "hit_ratio_range": [lo, hi], "cliff": hi - lo > CLIFF}


def changed_requests(trace: Trace, hits: Sequence[int]) -> int:
    """Requests whose host hits (chunks, per record) differ from the host chunks they recorded."""
    recorded = (trace.host // trace.header.chunk_tokens).tolist()
    return sum(1 for h, r in zip(hits, recorded, strict=True) if h != r)


def _predict(trace: Trace, distances: np.ndarray, at: Sequence[int],
             chunk_bytes: int) -> list[dict[str, Any]]:
    """Hit ratios of host tiers of `at` bytes: the LRU curve's, and the host tier's own behind the
    recorded device hits (`replay.py`), with its range over the sizes around each."""
    width = cliff_chunks(trace)
    refs = max(1, len(trace.refs))
    rows = []
    for b in at:
        size = b // chunk_bytes
        around = _around(size, width)
        hits = dict(zip(around, host_hits(trace, around), strict=True))
        (lru,) = lru_hit_ratios(distances, [size])
        changed = changed_requests(trace, hits[size])
        cliff = _cliff(around, [sum(h) / refs for h in hits.values()], chunk_bytes)
        rows.append({"bytes": b, "lru_hit_ratio": lru, "host_hit_ratio": sum(hits[size]) / refs,
                     "changed_requests": changed, **cliff, "cliff": cliff["cliff"] and changed > 0})
    return rows


def _with_probation(rows: list[dict[str, Any]], runs: Sequence[HostRun]) -> list[dict[str, Any]]:
    """The `frequency` rows with the host tier's hit ratio and probation share at each `min_seen`."""
    return [{**row, "host_hit_ratio": run.hit_ratio, "probation_chunk_fraction": run.probation_fraction}
            for row, run in zip(rows, runs, strict=True)]


def plan(trace: Trace, chunk_bytes: int | None = None,
         host_bytes_per_s: float | None = None, at: Sequence[int] = (),
         host_bytes: int | None = None, prefill_tok_s: float | None = None) -> Plan:
    """The plan of a trace. `chunk_bytes` overrides the header's (required when it has none);
    `host_bytes_per_s` defaults to a measured host copy; `at`: host sizes (bytes) to predict the
    hit ratio of; `host_bytes`: the most host memory the host tier may take (None: no cap);
    `prefill_tok_s`: the engine's prefill rate (None: from the trace's TTFTs)."""
    chunk_bytes = chunk_bytes or trace.header.chunk_bytes
    if not chunk_bytes:
        raise TraceError("the trace does not say the bytes of a chunk: pass --bytes-per-token")
    budget = host_bytes_per_s or measure_host_bytes_per_s()
    stream = analysis.Stream.of(trace)
    refs = len(trace.refs)
    working_set = len(stream.key_refs)
    distances = stack_distances(stream.prev)
    lru_sizes = _sizes(working_set, LRU_POINTS)
    arc_sizes = _sizes(working_set, ARC_POINTS)
    lru = lru_hit_ratios(distances, lru_sizes)
    arc = simulate(ARCPolicy, trace.refs, arc_sizes, sample_rate(trace.refs))
    reachable = float(stream.reuse.sum()) / refs if refs else 0.0
    capture = {f"{int(q * 100)}%": _capture(distances, refs, q) * chunk_bytes for q in CAPTURE}

    times = analysis.reuse_times(stream)
    samples = times.pop("reuse_time_samples")
    rows = chunk_sizes(stream, chunk_bytes, budget)
    chunk_tokens = recommend_chunk_tokens(rows)
    bypass = analysis.bypass(stream)
    admission = bypass["admission"]
    cpu = _capture(distances, refs, CAPTURE[0])
    if host_bytes is not None:
        cpu = min(cpu, host_bytes // chunk_bytes)
    secondary = _capture(distances, refs, CAPTURE[-1])
    cpu_hit, secondary_hit = lru_hit_ratios(distances, [cpu, secondary])
    cpu_around = _around(cpu, cliff_chunks(trace))
    arc_at_cpu = simulate(ARCPolicy, trace.refs, [cpu], sample_rate(trace.refs))[0]
    runs = host_runs(stream, cpu, [r["min_seen"] for r in admission["frequency"]])
    admission["frequency"] = _with_probation(admission["frequency"], runs)
    prefixes = analysis.shared_prefixes(stream)
    decision = decide(Evidence(
        prefixes["reusable_token_fraction"], chunk_bytes, trace.header.chunk_tokens, budget,
        prefill_tok_s or prefill_tokens_per_s(trace), cpu * chunk_bytes, reachable,
        times["reuse_gap_s"]["p50"], runs))
    frequency = (decision["verdict_checks"]["admission_min_seen"]
                 if decision["verdict"] == WITH_ADMISSION
                 else _pick_admission(admission["frequency"], "min_seen", 0.90))
    report: dict[str, Any] = {
        **decision,
        "requests": int((trace.prompt > 0).sum()) or trace.records,
        "records": trace.records,
        "source": trace.header.source,
        "duration_s": float(trace.t[-1] - trace.t[0]),
        "prompt_tokens": int(analysis.prompt_tokens(trace).sum()),
        "context_length_tokens": analysis.context_lengths(trace),
        "chunk_references": refs,
        "chunk_tokens": trace.header.chunk_tokens,
        "chunk_bytes": chunk_bytes,
        "cliff_chunks": cliff_chunks(trace),
        "token_sources": trace.sources,
        "observed_hit_ratio": _observed(trace),
        **prefixes,
        **times,
        "host_gib_s": budget / GIB,
        "chunk_size": rows,
        "never_reused_chunk_fraction": bypass["never_reused_chunk_fraction"],
        "admission": admission,
        "host_bytes_limit": host_bytes,
        "working_set_bytes": working_set * chunk_bytes,
        "reachable_hit_ratio": reachable,
        "capture_bytes": capture,
        "mrc": {
            "lru": [[s * chunk_bytes, h] for s, h in zip(lru_sizes, lru, strict=True)],
            "arc": [[s * chunk_bytes, h] for s, h in zip(arc_sizes, arc, strict=True)],
        },
        "recommend": {
            "cpu_bytes_to_use": cpu * chunk_bytes,
            "cpu_hit_ratio": cpu_hit,
            "cpu_cliff": _cliff(cpu_around, lru_hit_ratios(distances, cpu_around), chunk_bytes),
            "eviction_policy": "arc" if arc_at_cpu > cpu_hit + 0.01 else "lru",
            "max_bytes": secondary * chunk_bytes,
            "max_bytes_hit_ratio": secondary_hit,
            "chunk_tokens": chunk_tokens,
            "blocks_per_chunk": chunk_tokens // trace.header.block_size,
            "admission": {
                "frequency_min_seen": frequency,
                "min_retention_priority": _pick_admission(
                    admission["priority"], "min_retention_priority", 0.99),
            },
        },
    }
    if at:
        report["predict"] = _predict(trace, distances, at, chunk_bytes)
    return Plan(report, samples)
