"""Results on disk and on screen: JSON (the record), CSV, a terminal table and a PNG.

A results file is one JSON object: `meta` (preset, workload, cache sizes, mode, model, command,
machine, load average) and `points` (one `stats.point_summary` each). `load` reads several files
and labels their points with the file's `meta.label` when they are compared, so runs from
different machines can be drawn together (`kvtier bench report`).

The PNG has two panels against the number of conversations, one line per configuration: token
throughput (prompt + output tokens/s) and p99 time to first token.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn.stats import PERCENTILES
from kvtier.chunks import DEVICE, RECOMPUTED

Point = dict[str, Any]


def save(path: Path, meta: dict[str, Any], points: Sequence[Point]) -> None:
    """Write the results JSON atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"meta": meta, "points": list(points)}, indent=1) + "\n")
    os.replace(tmp, path)


def load(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], list[Point]]:
    """Metas and points of results files; with several files each point's config is prefixed
    with its file's label (`meta.label`, else the file name)."""
    metas: list[dict[str, Any]] = []
    points: list[Point] = []
    for path in paths:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a results file ({e})") from e
        if not isinstance(raw, dict) or not isinstance(raw.get("points"), list):
            raise ValueError(f"{path}: not a results file (no 'points' list)")
        meta = dict(raw.get("meta") or {})
        label = str(meta.get("label") or Path(path).stem)
        metas.append(meta)
        for point in raw["points"]:
            p = dict(point)
            if len(paths) > 1:
                p["config"] = f"{label}: {p['config']}"
            points.append(p)
    return metas, points


def sources(points: Sequence[Point]) -> list[str]:
    """Every token source in `points`: device, host, secondary tiers, recomputed."""
    seen: list[str] = []
    for p in points:
        seen += [s for s in p.get("tokens", {}) if s not in seen]
    middle = [s for s in seen if s not in (DEVICE, RECOMPUTED)]
    return [DEVICE, *middle, RECOMPUTED]


def _fmt(value: float, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:,.{digits}f}"


def table(points: Sequence[Point]) -> str:
    """A Markdown table, one row per point, in the order given."""
    srcs = sources(points)
    head = ["config", "conv", "prompt tok/s", "output tok/s", "req/s", "TTFT p50 / p95 / p99 (s)",
            "ITL p50 / p99 (ms)", f"tokens {' / '.join(srcs)}", "reloaded", "preempt", "client lag p99 (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        ttft, itl = p["ttft_s"], p["itl_s"]
        lag = (p.get("client") or {}).get("loop_lag_ms", {}).get("p99", math.nan)
        row = [p["config"], str(p["conversations"]), _fmt(p["prompt_tokens_per_s"]),
               _fmt(p["output_tokens_per_s"], digits=1), _fmt(p["requests_per_s"], digits=2),
               " / ".join(_fmt(ttft[f"p{q}"], digits=2) for q in PERCENTILES),
               f"{_fmt(itl['p50'], 1000)} / {_fmt(itl['p99'], 1000)}",
               " / ".join(str(p["tokens"].get(s, 0)) for s in srcs)
               + ("" if p.get("tokens_sum_ok", True) else " (!)"),
               str(p.get("reloaded_tokens", "-")), str(p.get("preemptions", "-")), _fmt(lag, digits=1)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def csv_rows(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Flat rows: percentiles and token sources as their own columns."""
    srcs = sources(points)
    rows = []
    for p in points:
        client = p.get("client") or {}
        row: dict[str, Any] = {k: p.get(k) for k in (
            "config", "conversations", "requests", "failed_requests", "duration_s", "prompt_tokens",
            "output_tokens", "prompt_tokens_per_s", "output_tokens_per_s", "requests_per_s")}
        for metric in ("ttft_s", "itl_s"):
            for q in PERCENTILES:
                row[f"{metric}_p{q}"] = p[metric][f"p{q}"]
        for s in srcs:
            row[f"tokens_{s}"] = p["tokens"].get(s, 0)
        row.update({k: p.get(k) for k in ("reused_tokens", "reloaded_tokens", "preemptions",
                                           "tokens_sum_ok", "tokens_from")})
        row["client_loop_lag_p99_ms"] = client.get("loop_lag_ms", {}).get("p99")
        row["client_cpu_fraction"] = client.get("cpu_fraction")
        rows.append(row)
    return rows


def write_csv(path: Path, points: Sequence[Point]) -> None:
    rows = csv_rows(points)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["config"])
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, points: Sequence[Point], title: str) -> None:
    """The two-panel PNG (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_config: dict[str, list[Point]] = {}
    for p in points:
        by_config.setdefault(p["config"], []).append(p)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in by_config.items():
        pts = sorted(pts, key=lambda p: p["conversations"])
        xs = [p["conversations"] for p in pts]
        left.plot(xs, [p["prompt_tokens_per_s"] + p["output_tokens_per_s"] for p in pts],
                  marker="o", label=name)
        right.plot(xs, [p["ttft_s"]["p99"] for p in pts], marker="o", label=name)
    left.set_ylabel("throughput (prompt + output tokens/s)")
    right.set_ylabel("TTFT p99 (s)")
    right.set_yscale("log")
    plain = matplotlib.ticker.FormatStrFormatter("%g")
    right.yaxis.set_major_formatter(plain)
    right.yaxis.set_minor_formatter(plain)
    for ax in (left, right):
        ax.set_xlabel("conversations")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0 if ax is left else None)
    left.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_all(out_dir: Path, meta: dict[str, Any], points: Sequence[Point]) -> dict[str, Path]:
    """results.json, results.csv and results.png in `out_dir`; their paths."""
    paths = {"json": out_dir / "results.json", "csv": out_dir / "results.csv",
             "png": out_dir / "results.png"}
    save(paths["json"], meta, points)
    write_csv(paths["csv"], points)
    if points:
        plot(paths["png"], points, str(meta.get("title", "kvtier bench multiturn")))
    return paths
