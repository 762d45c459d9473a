"""kvtier's Prometheus metrics, declared in one place (`METRICS`), all named `kvtier_*`.

Labels are bounded: `tier` is "host" or a configured secondary tier's name; `op` is "store" or
"load"; `reason` is a configured admission policy's name (`rejected_chunks`, `probation_chunks`)
or why a stored chunk was rejected (`bad_chunks`: a `ChunkError` value); `counter` a
`TierCounter` value and `gauge` a `TierGauge` value (what a secondary tier counts itself, declared
here like every other metric, and reported as a `TierCounts`); `cause` one of
`kvtier.tiers.process.FAILURE_CAUSES`; `config_info` carries the configuration
(one series per engine); `source` is "device", "host", a
secondary tier's name, "recomputed_by_choice" (`load_policy: auto` judged recomputing sooner), or
"recomputed". For the host tier,
"store" is a device → host copy and "load" a host → device copy; for a secondary tier, "store" is
a cascade (host → tier) and "load" a promotion (tier → host).

`KVTierMetrics` holds one set in its own `CollectorRegistry` (two instances in one process never
collide), readable in-process with `snapshot()`. Every update is also queued as a delta that
`take_delta()` hands over (a JSON-able dict): the vLLM connector ships it through vLLM's
connector-stats path to the process that serves `/metrics`, where `apply_delta` replays it into
the same metrics created there (see `kvtier.integrations.vllm.connector_stats`).

Threading: one owner thread (the scheduler's) updates and takes deltas; `snapshot()` may be read
from any thread (prometheus_client's metrics are thread-safe).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.format.chunks import DEVICE, HOST, RECOMPUTED, ChunkError

PREFIX = "kvtier_"
Kind = Literal["counter", "gauge", "histogram"]
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: `name` without the prefix, and for counters without `_total`."""

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()

    @property
    def full_name(self) -> str:
        return PREFIX + self.name


class TierCounter(enum.Enum):
    """What a secondary tier counts itself (the tiers that count it in brackets); the value is the
    `counter` label of `tier_counter`. Bad chunks are counted by reason, as `ChunkError`s."""

    STORED = "stored"
    """Chunks written to the tier (fs, obj, redis)."""
    LOADED = "loaded"
    """Chunks copied from the tier into host-region slots, verified (fs, obj, redis, p2p)."""
    STORE_FAILURES = "store_failures"
    """Chunks whose store failed (fs, obj, redis)."""
    LOAD_FAILURES = "load_failures"
    """Chunks whose load failed, misses and bad chunks included (fs, obj, redis, p2p)."""
    LOAD_MISSES = "load_misses"
    """Loads of a chunk the tier (p2p: the holder) no longer had (fs, obj, redis, p2p)."""
    EVICTIONS = "evictions"
    """Chunks removed to stay under `max_bytes` (fs, obj)."""
    RESCANS = "rescans"
    """Scans of the chunk directory (fs)."""
    HEADS = "heads"
    """HEAD requests that answered lookups (obj)."""
    LOOKUP_FAILURES = "lookup_failures"
    """HEAD requests that failed (obj): the lookup answered a brief miss."""
    LISTINGS = "listings"
    """Listings of the bucket's chunk objects (obj)."""
    LOOKUPS = "lookups"
    """Keys asked of the server (redis) or of the peers (p2p)."""
    CONNECTION_ERRORS = "connection_errors"
    """Times the server was marked down after a failed request (redis)."""
    LOOKUPS_SERVED = "lookups_served"
    """Keys peers asked this instance about (p2p)."""
    DATA_REQUESTS = "data_requests"
    """Batches of chunks peers asked this instance for (p2p)."""
    CHUNKS_SERVED = "chunks_served"
    """Chunks sent whole to a peer (p2p)."""
    SERVE_MISSES = "serve_misses"
    """Chunks a peer asked for that this instance no longer offered (p2p)."""
    SERVE_ABORTED = "serve_aborted"
    """Chunks whose host slot was reused while being sent (p2p): the peer discards them."""
    STALE_DROPPED = "stale_dropped"
    """Offered chunks forgotten because their host slot was found reused (p2p)."""
    AUTH_REFUSED = "auth_refused"
    """Control messages, data connections or CURVE handshakes refused as unauthenticated (p2p)."""
    MALFORMED = "malformed"
    """Control messages or data connections dropped as malformed (p2p)."""
    PEER_ERRORS = "peer_errors"
    """Failed exchanges with a holder peer, which is then left alone a while (p2p)."""
    DISCOVERY_REFRESHES = "discovery_refreshes"
    """Peer lists read from the discovery server (p2p)."""


class TierGauge(enum.Enum):
    """What a secondary tier reports as it is now; the value is the `gauge` label of `tier_gauge`."""

    DIRECT_IO = "direct_io"
    """1 when the chunk files are read and written with O_DIRECT (fs)."""
    NATIVE_IO = "native_io"
    """1 when the native I/O helper is in use (fs)."""
    HIREDIS = "hiredis"
    """1 when replies are parsed by hiredis (redis)."""
    SERVER_DOWN = "server_down"
    """1 while the server is taken as down after a failed request (redis)."""
    PEERS = "peers"
    """Peers this instance knows (p2p)."""
    SERVING_CONNECTIONS = "serving_connections"
    """Data connections peers hold open to this instance (p2p)."""


TierStat = TierCounter | ChunkError | TierGauge
"""One value a secondary tier reports: a count of its own, a count of the stored chunks it rejected
for one reason, or a gauge."""


@dataclass(frozen=True)
class TierCounts:
    """What one secondary tier reported (`SecondaryTier.counts`), or what the metrics hold of it
    (`KVTierMetrics.tier_counts`): counts since the tier was built (in the metrics: since the
    engine started, over every tier process), gauges as of the report. An absent value is 0."""

    values: Mapping[TierStat, float] = field(default_factory=dict)

    def __getitem__(self, stat: TierStat) -> float:
        return self.values.get(stat, 0.0)

    @property
    def bad_chunks(self) -> float:
        """Stored chunks rejected, every reason together."""
        return sum(v for k, v in self.values.items() if isinstance(k, ChunkError))

    def as_json(self) -> dict[str, dict[str, float]]:
        """For reports: {metric name: {label value: value}} (`tier_counter`, `bad_chunks`, `tier_gauge`)."""
        out: dict[str, dict[str, float]] = {name: {} for name in TIER_STAT_METRICS.values()}
        for stat, value in self.values.items():
            out[TIER_STAT_METRICS[type(stat)]][stat.value] = value
        return out


TIER_STAT_METRICS: dict[type[TierStat], str] = {
    TierCounter: "tier_counter", ChunkError: "bad_chunks", TierGauge: "tier_gauge",
}
"""The metric that carries each kind of `TierStat` (its second label: the value's `.value`)."""

_T, _O, _S = ("tier",), ("tier", "op"), ("source",)
CONFIG_LABELS = ("eviction_policy", "admission_policy", "tiers", "cpu_bytes_to_use", "blocks_per_chunk")
"""`config_info`'s labels: one series per engine, set once at start."""
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("used_bytes", "gauge", "Bytes of KV chunks held by the tier", _T),
    MetricSpec("used_chunks", "gauge", "KV chunks held by the tier", _T),
    MetricSpec("capacity_bytes", "gauge", "Capacity of the tier in bytes (0: unbounded)", _T),
    MetricSpec("used_fraction", "gauge", "used_bytes / capacity_bytes (0 when unbounded)", _T),
    MetricSpec("transfer_chunks", "counter", "Chunks moved (store: into the tier; load: out)", _O),
    MetricSpec("transfer_bytes", "counter", "Bytes moved (store: into the tier; load: out)", _O),
    MetricSpec("transfer_seconds", "counter", "Seconds spent moving chunks, summed over jobs", _O),
    MetricSpec("transfer_latency_seconds", "histogram", "Duration of one transfer job", _O),
    MetricSpec("failures", "counter", "Chunks whose store or load failed (a failed load is a miss)", _O),
    MetricSpec("bad_chunks", "counter",
               "Stored chunks a tier rejected (header or checksum), removed and treated as misses",
               ("tier", "reason")),
    MetricSpec("tier_counter", "counter",
               "What a secondary tier counted itself, by `TierCounter` (its process's counts, summed "
               "over restarts)", ("tier", "counter")),
    MetricSpec("tier_gauge", "gauge", "What a secondary tier reported as it is now, by `TierGauge`",
               ("tier", "gauge")),
    MetricSpec("lookups", "counter", "Requests whose prefix kvtier looked up past the device hit"),
    MetricSpec("lookup_chunks", "counter", "Chunks looked up past the device prefix-cache hit"),
    MetricSpec("hit_chunks", "counter", "Looked-up chunks served by the tier (host: already there)", _T),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens by where their KV came from", _S),
    MetricSpec("tenant_prompt_tokens", "counter",
               "Prompt tokens by tenant (a `tenants` salt, `other` for the rest, `none`: no salt) and by "
               "where their KV came from; counted with `tenants` set", ("tenant", "source")),
    MetricSpec("tenant_bytes", "gauge", "Bytes each tenant holds in the tier (host: rows being written or "
               "ready; a secondary tier: chunks it reported stored), with `tenants` set", ("tenant", "tier")),
    MetricSpec("promotion_refused_chunks", "counter",
               "Chunks not promoted because the host tier had no room for them (they are recomputed)"),
    MetricSpec("cascade_skipped_chunks", "counter",
               "Chunks not copied to the tier because their host rows could not be pinned", _T),
    MetricSpec("admitted_chunks", "counter", "Chunks the admission policies let into the tier", _T),
    MetricSpec("rejected_chunks", "counter",
               "Chunks kept out of the tier, by the admission policy that refused them (for a secondary "
               "tier: or that put them on host probation; they may cascade later, once reused)",
               ("tier", "reason")),
    MetricSpec("probation_chunks", "counter",
               "Chunks stored on probation (evicted first, not cascaded until reused), by the admission "
               "policy that put them there", ("tier", "reason")),
    MetricSpec("probation_reused_chunks", "counter",
               "Probation chunks a later request reused: they settled and were cascaded then", _T),
    MetricSpec("tier_enabled", "gauge",
               "1 while the secondary tier takes loads and stores, 0 once disabled (guard or operator)", _T),
    MetricSpec("slo_rollbacks", "counter", "Secondary tiers the SLO guard disabled"),
    MetricSpec("slo_alerts", "counter", "Sustained SLO budget overruns the guard only reported"),
    MetricSpec("slo_over_budget", "gauge", "1 while a latency p99 the SLO guard watches is over budget"),
    MetricSpec("promotion_wait_seconds", "histogram",
               "Time a request waited for its promotion ('ask again' steps), by source tier", _T),
    MetricSpec("tier_up", "gauge", "1 while the secondary tier's process is up, 0 while it is down", _T),
    MetricSpec("tier_restarts", "gauge", "Times the secondary tier's process was restarted", _T),
    MetricSpec("tier_last_failure", "gauge",
               "Unix time of the secondary tier's latest failure with this cause (exited, hung, error, "
               "store_failed, load_failed); the most recent series is the last failure's cause",
               ("tier", "cause")),
    MetricSpec("jobs_in_flight", "gauge", "Store and load jobs submitted to the tier and not finished", _T),
    MetricSpec("host_pinned_chunks", "gauge", "Host-tier chunks pinned by copies in flight (not evictable)"),
    MetricSpec("load_fixed_seconds", "gauge",
               "Measured cost of one load job from the tier, before its bytes (decayed over recent jobs; "
               "host: a host to device copy)", _T),
    MetricSpec("load_bytes_per_second", "gauge",
               "Measured throughput of loads from the tier past their fixed cost (decayed; 0: unbounded)",
               _T),
    MetricSpec("prefill_tokens_per_second", "gauge",
               "Measured prompt tokens per second a step takes beyond its fixed cost (decayed over "
               "recent steps)"),
    MetricSpec("recomputed_by_choice_tokens", "counter",
               "Prompt tokens the tier held that were recomputed because that was judged sooner", _T),
    MetricSpec("load_probes", "counter",
               "Loads from a tier judged slower than recomputing, made to measure it again", _T),
    MetricSpec("load_give_ups", "counter",
               "Requests that stopped waiting for a promotion from the tier and recomputed instead", _T),
    MetricSpec("config_info", "gauge", "1, labelled with the configuration that produced these metrics",
               CONFIG_LABELS),
)
SPECS = {spec.name: spec for spec in METRICS}
OPS = ("store", "load")
"""The `op` label's values."""
RECOMPUTED_BY_CHOICE = "recomputed_by_choice"
"""The `source` of prompt tokens a tier held that `load_policy: auto` recomputed instead."""


def declared_series(
    secondary: Sequence[str], reasons: Sequence[str]
) -> list[tuple[str, tuple[str, ...]]]:
    """(metric name, label values) of every counter and histogram series an engine with these
    secondary tiers and these rejecting admission policies (`reasons`) can count, its labels
    known at start: the unlabelled ones, and those by tier ("host" and `secondary`), op, source
    and admission reason. Not here: series whose labels come with what happens (a tier's own
    counts, bad chunks by reason)."""
    tiers, pairs = (HOST, *secondary), [(t, op) for t in (HOST, *secondary) for op in OPS]
    series: list[tuple[str, tuple[str, ...]]] = [
        (name, ()) for name in ("lookups", "lookup_chunks", "promotion_refused_chunks",
                                "slo_rollbacks", "slo_alerts")]
    for name in ("transfer_chunks", "transfer_bytes", "transfer_seconds", "transfer_latency_seconds",
                 "failures"):
        series += [(name, pair) for pair in pairs]
    series += [("prompt_tokens", (s,)) for s in (DEVICE, *tiers, RECOMPUTED_BY_CHOICE, RECOMPUTED)]
    series += [(name, (t,)) for name in ("hit_chunks", "admitted_chunks", "recomputed_by_choice_tokens")
               for t in tiers]
    series += [("rejected_chunks", (t, r)) for t in tiers for r in reasons]
    series += [("probation_chunks", (HOST, r)) for r in reasons]
    series += [("probation_reused_chunks", (HOST,))]
    series += [(name, (t,)) for name in ("cascade_skipped_chunks", "promotion_wait_seconds",
                                         "load_probes", "load_give_ups")
               for t in secondary]
    return series


def new_metric(spec: MetricSpec, labelnames: Sequence[str], factory: Callable[..., Any]) -> Any:
    """Create `spec` with `factory` (a prometheus_client class or vLLM's wrapper of one), with
    `labelnames` before the spec's own labels."""
    kwargs: dict[str, Any] = {
        "name": spec.full_name,
        "documentation": spec.doc,
        "labelnames": [*labelnames, *spec.labels],
    }
    if spec.kind == "histogram":
        kwargs["buckets"] = LATENCY_BUCKETS
    return factory(**kwargs)


def apply_delta(delta: Mapping[str, Any], metric_of: Callable[[str], Any], prefix: Sequence[str]) -> None:
    """Replay a `take_delta()` dict into metrics: `metric_of(name)` gives the metric (or None to
    skip it), `prefix` the label values that come before the spec's own."""
    for name, labels, value in delta.get("counter", ()):
        metric = metric_of(name)
        if metric is not None:
            metric.labels(*prefix, *labels).inc(value)
    for name, labels, value in delta.get("gauge", ()):
        metric = metric_of(name)
        if metric is not None:
            metric.labels(*prefix, *labels).set(value)
    for name, labels, values in delta.get("histogram", ()):
        metric = metric_of(name)
        if metric is not None:
            child = metric.labels(*prefix, *labels)
            for value in values:
                child.observe(value)


class KVTierMetrics:
    """One engine's kvtier metrics in a private registry, plus the delta queued for vLLM."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        factories: dict[Kind, Callable[..., Any]] = {
            "counter": Counter, "gauge": Gauge, "histogram": Histogram,
        }
        self._metrics = {
            spec.name: new_metric(
                spec, (), lambda factory=factories[spec.kind], **kw: factory(registry=self.registry, **kw)
            )
            for spec in METRICS
        }
        self._delta: dict[str, list[Any]] = {"counter": [], "gauge": [], "histogram": []}
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    def _child(self, name: str, labels: Sequence[str]) -> Any:
        metric = self._metrics[name]
        return metric.labels(*labels) if labels else metric

    def inc(self, name: str, value: float, *labels: str) -> None:
        """Add `value` (>= 0) to counter `name`; zero increments are dropped."""
        if value:
            self._child(name, labels).inc(value)
            self._delta["counter"].append([name, list(labels), value])

    def set(self, name: str, value: float, *labels: str) -> None:
        """Set gauge `name`; queued for vLLM only when it changed."""
        key = (name, tuple(labels))
        if self._gauges.get(key) != value:
            self._gauges[key] = value
            self._child(name, labels).set(value)
            self._delta["gauge"].append([name, list(labels), value])

    def observe(self, name: str, value: float, *labels: str) -> None:
        """Add one observation to histogram `name`."""
        self._child(name, labels).observe(value)
        delta = self._delta["histogram"]
        if delta and delta[-1][0] == name and delta[-1][1] == list(labels):
            delta[-1][2].append(value)
        else:
            delta.append([name, list(labels), [value]])

    def declare(self, secondary: Sequence[str], reasons: Sequence[str]) -> None:
        """Create every `declared_series` at zero (histograms empty), queued for vLLM like any
        update, and the SLO guard's `slo_over_budget` at 0: a dashboard then reads 0 where
        nothing happened yet, not "no data". Called once, when the engine's tiers are known."""
        for name, labels in declared_series(secondary, reasons):
            self._child(name, labels)
            if SPECS[name].kind == "histogram":
                self._delta["histogram"].append([name, list(labels), []])
            else:
                self._delta["counter"].append([name, list(labels), 0])
        self.set("slo_over_budget", 0.0)

    def take_delta(self) -> dict[str, list[Any]] | None:
        """The updates since the last call (None when there are none), for `apply_delta`."""
        if not any(self._delta.values()):
            return None
        delta, self._delta = self._delta, {"counter": [], "gauge": [], "histogram": []}
        return delta

    def snapshot(self) -> dict[str, float]:
        """Every sample now, keyed `name{label="value",...}` as in Prometheus' text format
        (counters end in `_total`; histograms give `_count` and `_sum`, not their buckets)."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket")):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def count_tier(self, tier: str, counts: TierCounts, since: TierCounts) -> None:
        """Add what tier `tier` counted between two of its reports (`since`: the earlier one, empty
        for a new tier process) and set its gauges."""
        for stat, value in counts.values.items():
            name = TIER_STAT_METRICS[type(stat)]
            if isinstance(stat, TierGauge):
                self.set(name, value, tier, stat.value)
            elif (new := value - since[stat]) > 0:
                self.inc(name, new, tier, stat.value)

    def tier_counts(self, tier: str) -> TierCounts:
        """What the metrics hold of tier `tier`'s own counts and gauges (`count_tier`)."""
        values: dict[TierStat, float] = {}
        for kind, name in TIER_STAT_METRICS.items():
            label = SPECS[name].labels[1]
            for family in self._metrics[name].collect():
                for sample in family.samples:
                    if sample.name.endswith("_created") or sample.labels.get("tier") != tier:
                        continue
                    values[kind(sample.labels[label])] = sample.value
        return TierCounts(values)

    def value(self, name: str, **labels: str) -> float:
        """One sample of `snapshot()` by full sample name and labels; 0 when absent."""
        text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return self.snapshot().get(f"{name}{{{text}}}" if text else name, 0.0)
