"""Per-request records and the per-point summary the benchmark reports.

A point is one run of the workload (one configuration, one number of conversations). Its
throughput counts every prompt token served (cached or computed) and every output token over the
wall time from the first request sent to the last one finished; TTFT and ITL percentiles are over
all requests (ITL: every gap between consecutive output chunks of a request; end-to-end latency
`e2e_s`: from sending the request to its last chunk). A point with single-use requests mixed in
(`workload.Mix`) also reports them apart (`single_use`).

`tokens` is where the prompt tokens came from, as in `kvtier demo`: `device` (vLLM's own prefix
cache), `host` (kvtier's host tier), one entry per secondary tier by name, and `recomputed`. The
entries add up to `prompt_tokens` (`tokens_sum_ok` says whether the source agreed).

A point run several times (repeats) is reported as the median and the spread (min-max) of each
metric over its runs (`Spread`, `repeat_summary`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.format.chunks import DEVICE, HOST, RECOMPUTED
from kvtier.ops.metrics import RECOMPUTED_BY_CHOICE

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
    single_use: bool = False  # a mixed-in one-turn request (`workload.Mix`)
    step: int = 0  # the ramp step it started in
    instance: int = 0  # the fleet instance that served it (`fleet`; 0 for one endpoint)


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
    reused = prompt - split[RECOMPUTED] - split.get(RECOMPUTED_BY_CHOICE, 0)
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
        "e2e_s": summary([r.end_s - r.start_s for r in ok]),
        "tokens": split,
        "tokens_sum_ok": sum(split.values()) == prompt,
        "reused_tokens": reused,
        "reloaded_tokens": reused - split[DEVICE],
    }
    singles = [r for r in ok if r.single_use]
    if singles:
        point["single_use"] = _single_use(ok, singles, split)
    point.update(extra or {})
    return point


def _single_use(ok: Sequence[RequestRecord], singles: Sequence[RequestRecord],
                split: Mapping[str, int]) -> dict[str, Any]:
    """The mixed workload's two kinds apart: latency of the single-use requests and of the
    conversations' turns, and the conversations' own token split: the point's split less the
    single-use prompts, which are recomputed whole since no chunk of theirs was seen before
    (`workload`), and `conversation_host_hit`, the share of the turns' prompt tokens the host
    tier supplied."""
    turns = [r for r in ok if not r.single_use]
    single_prompt = sum(r.prompt_tokens for r in singles)
    conv_split = {**split, RECOMPUTED: split.get(RECOMPUTED, 0) - single_prompt}
    conv_prompt = sum(r.prompt_tokens for r in turns)
    return {
        "requests": len(singles), "prompt_tokens": single_prompt,
        "ttft_s": summary([r.ttft_s for r in singles]),
        "e2e_s": summary([r.end_s - r.start_s for r in singles]),
        "turn_ttft_s": summary([r.ttft_s for r in turns]),
        "turn_e2e_s": summary([r.end_s - r.start_s for r in turns]),
        "conversation_tokens": conv_split,
        "conversation_host_hit": split.get(HOST, 0) / conv_prompt if conv_prompt else math.nan,
    }


@dataclass(frozen=True)
class Spread:
    """One metric over a point's runs: the median, the lowest and highest value, and how many runs
    had a value (NaN and 0 when none had)."""

    median: float
    low: float
    high: float
    runs: int

    def as_json(self) -> dict[str, float | None]:
        """The fields as strict JSON: null where no run had a value."""
        def number(value: float) -> float | None:
            return None if math.isnan(value) else value
        return {"median": number(self.median), "min": number(self.low), "max": number(self.high),
                "runs": self.runs}


def spread(values: Sequence[float]) -> Spread:
    """The `Spread` of `values`, NaNs left out; the median of an even count is the mean of the two
    middle values."""
    present = [float(v) for v in values if not math.isnan(v)]
    if not present:
        return Spread(math.nan, math.nan, math.nan, 0)
    return Spread(percentile(present, 50), min(present), max(present), len(present))


def _at(*path: str) -> Callable[[Mapping[str, Any]], float]:
    def get(point: Mapping[str, Any]) -> float:
        value: Any = point
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        return float(value) if isinstance(value, int | float) else math.nan
    return get


SPREAD_METRICS: dict[str, Callable[[Mapping[str, Any]], float]] = {
    "prompt_tokens_per_s": _at("prompt_tokens_per_s"),
    "output_tokens_per_s": _at("output_tokens_per_s"),
    "tokens_per_s": lambda p: _at("prompt_tokens_per_s")(p) + _at("output_tokens_per_s")(p),
    "requests_per_s": _at("requests_per_s"),
    **{f"ttft_s.p{q}": _at("ttft_s", f"p{q}") for q in PERCENTILES},
    **{f"itl_s.p{q}": _at("itl_s", f"p{q}") for q in PERCENTILES},
    **{f"e2e_s.p{q}": _at("e2e_s", f"p{q}") for q in PERCENTILES},
    "conversation_host_hit": _at("single_use", "conversation_host_hit"),
    "reused_tokens": _at("reused_tokens"),
    "reloaded_tokens": _at("reloaded_tokens"),
    "preemptions": _at("preemptions"),
    "client.loop_lag_ms.p99": _at("client", "loop_lag_ms", "p99"),
}
"""The metrics summarized over repeats, by name (a dotted name is a path into the point);
`tokens_per_s` is prompt + output tokens per second. Token sources are summarized too, as
`tokens.<source>`."""


def repeat_summary(points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (configuration, conversations, ramp concurrency), in the order of their first
    point: `config`, `conversations`, `concurrency` (a ramp step's, else None), `runs` (how many
    points), `tokens_sum_ok` (all runs agreed) and `metrics`: a
    `Spread` (as JSON) per `SPREAD_METRICS` name and per `tokens.<source>`."""
    groups: dict[tuple[str, int, int | None], list[Mapping[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["config"], p["conversations"], (p.get("ramp") or {}).get("concurrency")),
                          []).append(p)
    out = []
    for (config, conversations, concurrency), runs in groups.items():
        metrics = {name: spread([get(p) for p in runs]).as_json() for name, get in SPREAD_METRICS.items()}
        for source in dict.fromkeys(s for p in runs for s in p.get("tokens", {})):
            metrics[f"tokens.{source}"] = spread([float(p["tokens"].get(source, 0)) for p in runs]).as_json()
        out.append({"config": config, "conversations": conversations, "concurrency": concurrency,
                    "runs": len(runs),
                    "tokens_sum_ok": all(p.get("tokens_sum_ok", True) for p in runs), "metrics": metrics})
    return out
