"""kvtier's metrics: one private registry per instance, snapshot by value, deltas replayed exactly."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.format.chunks import ChunkError
from kvtier.ops.metrics import (
    CONFIG_LABELS,
    METRICS,
    PREFIX,
    SPECS,
    TIER_STAT_METRICS,
    KVTierMetrics,
    TierCounter,
    TierCounts,
    TierGauge,
    apply_delta,
    new_metric,
)


def test_every_metric_has_the_prefix_and_bounded_labels() -> None:
    assert len({spec.name for spec in METRICS}) == len(METRICS)
    for spec in METRICS:
        assert spec.full_name.startswith(PREFIX)
        assert set(spec.labels) <= {"tier", "op", "source", "reason", "cause", "counter", "gauge",
                                     "tenant", *CONFIG_LABELS}


def test_every_tier_stat_has_its_metric_and_a_distinct_label() -> None:
    """A tier's counts are declared here once: each kind has its metric, whose label takes the
    members' values (no two alike)."""
    for kind, name in TIER_STAT_METRICS.items():
        assert SPECS[name].labels[0] == "tier" and len(SPECS[name].labels) == 2
        assert len({m.value for m in kind}) == len(kind)
    assert SPECS["tier_counter"].kind == "counter" and SPECS["tier_gauge"].kind == "gauge"
    assert TIER_STAT_METRICS[ChunkError] == "bad_chunks"


def test_every_tier_count_reaches_the_metrics_once_across_restarts() -> None:
    """Every declared counter, bad-chunk reason and gauge a tier reports lands in its metric; counts
    add up over a tier process's generations (each starting from zero), gauges are as reported."""
    m = KVTierMetrics()
    stats = [*TierCounter, *ChunkError, *TierGauge]
    first = TierCounts({stat: 3.0 for stat in stats})
    m.count_tier("fs", first, TierCounts())
    m.count_tier("fs", first, first)  # the same report again: nothing new
    restarted = TierCounts({stat: 2.0 for stat in stats})  # a new process, counting from zero
    m.count_tier("fs", restarted, TierCounts())
    counts = m.tier_counts("fs")
    for stat in stats:
        assert counts[stat] == (2.0 if isinstance(stat, TierGauge) else 5.0), stat
    assert counts.bad_chunks == 5.0 * len(ChunkError)
    assert m.tier_counts("obj") == TierCounts()
    snap = m.snapshot()
    assert snap['kvtier_tier_counter_total{counter="chunks_served",tier="fs"}'] == 5
    assert snap['kvtier_bad_chunks_total{reason="wrong_layout",tier="fs"}'] == 5
    assert snap['kvtier_tier_gauge{gauge="peers",tier="fs"}'] == 2
    assert counts.as_json()["bad_chunks"]["checksum"] == 5


def test_two_instances_in_one_process_do_not_collide() -> None:
    a, b = KVTierMetrics(), KVTierMetrics()
    a.inc("transfer_bytes", 100, "host", "store")
    b.inc("transfer_bytes", 7, "host", "store")
    assert a.value("kvtier_transfer_bytes_total", tier="host", op="store") == 100
    assert b.value("kvtier_transfer_bytes_total", tier="host", op="store") == 7


def test_snapshot_by_value() -> None:
    m = KVTierMetrics()
    m.inc("prompt_tokens", 64, "device")
    m.inc("prompt_tokens", 32, "fs")
    m.inc("lookups", 1)
    m.set("used_bytes", 4096, "host")
    m.observe("transfer_latency_seconds", 0.25, "fs", "load")
    m.observe("transfer_latency_seconds", 0.5, "fs", "load")
    snap = m.snapshot()
    assert snap['kvtier_prompt_tokens_total{source="device"}'] == 64
    assert snap['kvtier_prompt_tokens_total{source="fs"}'] == 32
    assert snap["kvtier_lookups_total"] == 1
    assert snap['kvtier_used_bytes{tier="host"}'] == 4096
    assert snap['kvtier_transfer_latency_seconds_count{op="load",tier="fs"}'] == 2
    assert snap['kvtier_transfer_latency_seconds_sum{op="load",tier="fs"}'] == 0.75
    assert m.value("kvtier_prompt_tokens_total", source="recomputed") == 0


def test_delta_replays_into_metrics_of_another_registry() -> None:
    m = KVTierMetrics()
    m.inc("transfer_chunks", 3, "fs", "store")
    m.set("used_chunks", 5, "host")
    m.set("used_chunks", 5, "host")  # unchanged: not queued again
    m.observe("transfer_latency_seconds", 0.01, "host", "store")
    delta = m.take_delta()
    assert delta is not None and len(delta["gauge"]) == 1
    assert m.take_delta() is None
    m.inc("transfer_chunks", 2, "fs", "store")
    later = m.take_delta()
    assert later is not None

    registry = CollectorRegistry()
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    mirror = {
        s.name: new_metric(s, ["engine"], lambda k=kinds[s.kind], **kw: k(registry=registry, **kw))
        for s in METRICS
    }
    apply_delta(delta, mirror.get, ["0"])
    apply_delta(later, mirror.get, ["0"])
    get = registry.get_sample_value
    labels = {"engine": "0", "tier": "fs", "op": "store"}
    assert get("kvtier_transfer_chunks_total", labels) == 5
    assert get("kvtier_used_chunks", {"engine": "0", "tier": "host"}) == 5
    assert get("kvtier_transfer_latency_seconds_count", {"engine": "0", "tier": "host", "op": "store"}) == 1


def test_declared_series_read_zero_before_anything_happens_and_replay() -> None:
    """A dashboard reads 0, not "no data", for what has not happened yet: the declared series exist
    at zero in the engine's metrics and, through the delta, in vLLM's."""
    m = KVTierMetrics()
    m.declare(["fs"], ["frequency"])
    delta = m.take_delta()
    assert delta is not None
    registry = CollectorRegistry()
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    mirror = {s.name: new_metric(s, ["engine"], lambda k=kinds[s.kind], **kw: k(registry=registry, **kw))
              for s in METRICS}
    apply_delta(delta, mirror.get, ["0"])
    snap = m.snapshot()
    for name, labels in (("kvtier_failures_total", {"tier": "fs", "op": "load"}),
                         ("kvtier_prompt_tokens_total", {"source": "recomputed"}),
                         ("kvtier_rejected_chunks_total", {"tier": "fs", "reason": "frequency"}),
                         ("kvtier_probation_chunks_total", {"tier": "host", "reason": "frequency"}),
                         ("kvtier_promotion_wait_seconds_count", {"tier": "fs"}),
                         ("kvtier_slo_rollbacks_total", {}), ("kvtier_slo_over_budget", {})):
        text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        assert snap[f"{name}{{{text}}}" if text else name] == 0, name
        assert registry.get_sample_value(name, {"engine": "0", **labels}) == 0, name
    assert 'kvtier_promotion_wait_seconds_count{tier="host"}' not in snap  # host waits for nothing
    assert not any(k.startswith("kvtier_tier_last_failure") for k in snap)  # none happened


def test_vllm_prom_metrics_replay_stats_into_the_default_registry_twice() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from kvtier.integrations.vllm.connector import KVTierConnector

    m = KVTierMetrics()
    m.inc("prompt_tokens", 96, "fs")
    m.observe("transfer_latency_seconds", 0.1, "fs", "load")
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    config = SimpleNamespace(kv_transfer_config=None)
    for _ in range(2):  # a second engine in the same process replaces the first's collectors
        prom = KVTierConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})  # type: ignore[arg-type]
        stats = KVTierConnector.build_kv_connector_stats(m.take_delta() or {})
        assert stats is not None and not stats.is_empty()
        assert stats.reduce() == {"prompt_tokens": 96}
        prom.observe(stats.to_dict(), 0)
        assert REGISTRY.get_sample_value(
            "kvtier_prompt_tokens_total", {"engine": "0", "source": "fs"}) == 96
        m.inc("prompt_tokens", 96, "fs")
        m.observe("transfer_latency_seconds", 0.1, "fs", "load")
