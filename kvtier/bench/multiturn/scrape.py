"""The hit-quality breakdown of a served point, from counter deltas of the server's `/metrics`.

With kvtier the split is `kvtier_prompt_tokens_total{source=...}` (device, host, each secondary
tier by name, recomputed; counted when a request finishes). Without kvtier it is vLLM's
`vllm:prompt_tokens_by_source_total`: `local_cache_hit` is the device prefix cache, the rest
(`local_compute`, `external_kv_transfer`) is recomputed. Preemptions are
`vllm:num_preemptions_total`. Counters are summed over their other labels (engines, models).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from kvtier.format.chunks import DEVICE, HOST, RECOMPUTED

KVTIER_TOKENS = "kvtier_prompt_tokens_total"
VLLM_TOKENS = "vllm:prompt_tokens_by_source_total"
PREEMPTIONS = "vllm:num_preemptions_total"
TRANSFER_SECONDS = "kvtier_transfer_seconds_total"
TRANSFER_BYTES = "kvtier_transfer_bytes_total"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str) -> dict[Sample, float]:
    """Prometheus text exposition → {(name, sorted labels): value}; comments skipped."""
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        key = (name, tuple(sorted(_LABEL.findall(labels or ""))))
        out[key] = out.get(key, 0.0) + number
    return out


def by_label(samples: Mapping[Sample, float], name: str, label: str) -> dict[str, float]:
    """Values of counter `name` summed per value of `label`."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample != name:
            continue
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def total(samples: Mapping[Sample, float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0)) for k in after}


def kvtier_split(before: Mapping[Sample, float], after: Mapping[Sample, float]) -> dict[str, int]:
    """Prompt-token sources from kvtier's counters between two scrapes."""
    delta = _delta(by_label(before, KVTIER_TOKENS, "source"), by_label(after, KVTIER_TOKENS, "source"))
    split = {DEVICE: delta.pop(DEVICE, 0), HOST: delta.pop(HOST, 0)}
    split.update(sorted(delta.items()))
    split[RECOMPUTED] = split.pop(RECOMPUTED, 0)
    return split


def vllm_split(before: Mapping[Sample, float], after: Mapping[Sample, float]) -> dict[str, int]:
    """Prompt-token sources from vLLM's own counters: device prefix cache and recomputed."""
    delta = _delta(by_label(before, VLLM_TOKENS, "source"), by_label(after, VLLM_TOKENS, "source"))
    device = delta.pop("local_cache_hit", 0)
    return {DEVICE: device, RECOMPUTED: sum(delta.values())}


def preemptions(before: Mapping[Sample, float], after: Mapping[Sample, float]) -> int:
    return round(total(after, PREEMPTIONS) - total(before, PREEMPTIONS))


def transfers(before: Mapping[Sample, float], after: Mapping[Sample, float]) -> dict[str, dict[str, float]]:
    """kvtier's transfer time and bytes between two scrapes, per "<tier>.<op>" (host.store is
    device → host, host.load host → device, <tier>.store a cascade, <tier>.load a promotion)."""
    out: dict[str, dict[str, float]] = {}
    for name, field in ((TRANSFER_SECONDS, "seconds"), (TRANSFER_BYTES, "bytes")):
        for (sample, labels), value in after.items():
            if sample != name:
                continue
            tags = dict(labels)
            delta = value - before.get((sample, labels), 0.0)
            key = f"{tags.get('tier', '')}.{tags.get('op', '')}"
            entry = out.setdefault(key, {"seconds": 0.0, "bytes": 0.0})
            entry[field] += delta
    return out


Splitter = Callable[[Mapping[Sample, float], Mapping[Sample, float]], dict[str, int]]
