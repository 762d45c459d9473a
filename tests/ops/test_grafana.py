"""The Grafana dashboard in docs/grafana queries only series kvtier exports, and shows what the
operator's guide asks for."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from kvtier.ops.metrics import CONFIG_LABELS, METRICS, KVTierMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvtier.json"


def exported_series() -> set[str]:
    """Every series name a real exposition of kvtier's metrics holds, once each is touched."""
    metrics = KVTierMetrics()
    for spec in METRICS:
        labels = ["x"] * len(spec.labels)
        if spec.kind == "counter":
            metrics.inc(spec.name, 1, *labels)
        elif spec.kind == "gauge":
            metrics.set(spec.name, 1, *labels)
        else:
            metrics.observe(spec.name, 0.01, *labels)
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def test_every_queried_series_exists() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\bkvtier_[a-z0-9_]+", e)}
    series = exported_series()
    assert queried and queried <= series, sorted(queried - series)
    labels = {label for e in exprs for label in re.findall(r"by \(([^)]*)\)", e)}
    used = {name.strip() for group in labels for name in group.split(",")} - {"le"}
    declared = {label for spec in METRICS for label in spec.labels}
    assert used <= declared | set(CONFIG_LABELS), sorted(used - declared)


def test_the_guides_signals_are_on_the_dashboard() -> None:
    text = DASHBOARD.read_text()
    for name in ("kvtier_prompt_tokens_total", "kvtier_used_fraction", "kvtier_transfer_bytes_total",
                 "kvtier_transfer_latency_seconds_bucket", "kvtier_promotion_wait_seconds_bucket",
                 "kvtier_tier_enabled", "kvtier_slo_rollbacks_total", "kvtier_tier_up",
                 "kvtier_config_info", "kvtier_rejected_chunks_total", "kvtier_tier_last_failure",
                 "kvtier_probation_chunks_total", "kvtier_probation_reused_chunks_total"):
        assert name in text
