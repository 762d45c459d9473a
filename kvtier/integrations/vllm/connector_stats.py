"""kvtier metrics on vLLM's own `/metrics`, through vLLM's connector-stats path.

vLLM 0.32 moves connector metrics in three hops, all driven by vLLM:

1. Every engine step the scheduler calls the connector's `get_kv_connector_stats()`; the scheduler
   half returns a `KVTierStats` whose `data` is `KVTierMetrics.take_delta()` (the updates since the
   last step). With stats logging on (`vllm serve` default), vLLM puts `to_dict()` in its
   `SchedulerStats` and sends it to the front-end process; otherwise it is dropped (the in-process
   `KVTierMetrics.snapshot()` still has everything).
2. In the front-end, `build_kv_connector_stats(data)` rebuilds a `KVTierStats` for vLLM's periodic
   log line (`reduce()`: this interval's bytes and chunks moved).
3. Also in the front-end, `build_prom_metrics(...)` creates `KVTierPromMetrics` once: the same
   `kvtier_*` metrics as `kvtier.ops.metrics.METRICS`, made with vLLM's metric classes (so they land
   in the registry vLLM's `/metrics` serves, multiprocess mode included) and labelled with vLLM's
   engine labels first; `observe(data, engine_idx)` replays each delta.

vLLM removes its own `vllm:*` collectors from the default registry when a new engine starts in the
same process; `KVTierPromMetrics` does the same for earlier `kvtier_*` collectors there (and only
there), so a second engine in one process does not fail with duplicated metrics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.ops.metrics import METRICS, PREFIX, apply_delta, new_metric


@dataclass
class KVTierStats(KVConnectorStats):
    """One or more `KVTierMetrics.take_delta()` dicts, merged (lists concatenated)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = {kind: list(self.data.get(kind, ())) for kind in ("counter", "gauge", "histogram")}
        for kind, entries in other.data.items():
            merged.setdefault(kind, []).extend(entries)
        return KVTierStats(merged)

    def reduce(self) -> dict[str, int | float]:
        """This interval's counter increments by metric and op (e.g. `transfer_bytes.load`)."""
        totals: Counter[str] = Counter()
        for name, labels, value in self.data.get("counter", ()):
            op = labels[-1] if name.startswith("transfer") else ""
            totals[f"{name}.{op}" if op else name] += value
        return dict(totals)

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in ("counter", "gauge", "histogram"))


class KVTierPromMetrics(KVConnectorPromMetrics):
    """kvtier's metrics in the front-end process, fed from `KVTierStats` data."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()
        factories = {"counter": self._counter_cls, "gauge": self._gauge_cls,
                     "histogram": self._histogram_cls}
        self._metrics = {
            spec.name: new_metric(spec, labelnames, factories[spec.kind]) for spec in METRICS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Called by vLLM's Prometheus logger for each stats payload of engine `engine_idx`."""
        prefix = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        apply_delta(transfer_stats_data, self._metrics.get, prefix)


def _unregister_previous() -> None:
    for collector in list(REGISTRY._collector_to_names):
        name = getattr(collector, "_name", "")
        if isinstance(name, str) and name.startswith(PREFIX):
            REGISTRY.unregister(collector)
