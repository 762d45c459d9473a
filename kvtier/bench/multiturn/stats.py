"""Per-request records and the per-point summary the benchmark reports.

A point is one run of the workload (one configuration, one number of conversations). Its
throughput counts every prompt token served (cached or computed) and every output token over the
wall time from the first request sent to the last one finished; TTFT and ITL percentiles are over
all requests (ITL: every gap between consecutive output chunks of a request).

`tokens` is where the prompt tokens came from, as in `kvtier demo`: `device` (vLLM's own prefix
cache), `host` (kvtier's host tier), one entry per secondary tier by name, and `recomputed`. The
entries add up to `prompt_tokens` (`tokens_sum_ok` says whether the source agreed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.chunks import DEVICE, RECOMPUTED

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) with linear interpolation between order statistics (numpy's
    default method); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q}: must be between 0 and 100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 and the mean of `values` (NaN when empty)."""
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else math.nan
    return out


@dataclass
class RequestRecord:
    """One served turn, as the client saw it."""

    conversation: int
    turn: int
    start_s: float
    end_s: float
    ttft_s: float
    prompt_tokens: int
    output_tokens: int
    itl_s: list[float] = field(default_factory=list, repr=False)
    tokens: dict[str, int] | None = None  # the request's own split, when the runner has it
    error: str = ""


def sum_splits(splits: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Source-wise sum of token splits, `device` first and `recomputed` last."""
    total: dict[str, int] = {DEVICE: 0}
    for split in splits:
        for source, count in split.items():
            total[source] = total.get(source, 0) + int(count)
    total[RECOMPUTED] = total.pop(RECOMPUTED, 0)
    return total


def point_summary(config: str, conversations: int, records: Sequence[RequestRecord],
                  tokens: Mapping[str, int], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The reported point (see the module docstring); `extra` is merged in (client overhead,
    preemptions, ...). Failed requests are counted, not timed."""
    ok = [r for r in records if not r.error]
    start = min((r.start_s for r in records), default=0.0)
    end = max((r.end_s for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    split = sum_splits([tokens])
    reused = prompt - split[RECOMPUTED]
    point: dict[str, Any] = {
        "config": config,
        "conversations": conversations,
        "requests": len(ok),
        "failed_requests": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "prompt_tokens_per_s": prompt / duration,
        "output_tokens_per_s": output / duration,
        "requests_per_s": len(ok) / duration,
        "ttft_s": summary([r.ttft_s for r in ok]),
        "itl_s": summary([gap for r in ok for gap in r.itl_s]),
        "tokens": split,
        "tokens_sum_ok": sum(split.values()) == prompt,
        "reused_tokens": reused,
        "reloaded_tokens": reused - split[DEVICE],
    }
    point.update(extra or {})
    return point
