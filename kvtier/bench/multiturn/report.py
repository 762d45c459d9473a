"""Results on disk and on screen: JSON (the record), CSV, a terminal table and a PNG.

A results file is one JSON object: `meta` (preset, workload, cache sizes, repeats, mode, model,
command, machine, load average), `points` (one `stats.point_summary` per run, with its `repeat`
and `run`) and `summary` (`stats.repeat_summary`: median and min-max of each metric per
configuration and point). `load` reads several files and labels their points with the file's
`meta.label` when they are compared, so runs from different machines can be drawn together
(`kvtier bench report`).

The table has one row per configuration and point (and ramp step: "16 @4" is 16 conversations at
concurrency 4): each value is the median over its runs, with [min-max] when the runs differ. The
CSV has one row per run. The PNG has two panels against the number of conversations (the
concurrency of a ramp's steps), one line per configuration (the median, offset a little sideways
per configuration so that they do not hide each other) with the min-max spread as error bars:
token throughput (prompt + output tokens/s) and p99 time to first token.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn.summary import PERCENTILES, repeat_summary
from kvtier.format.chunks import DEVICE, RECOMPUTED

Point = dict[str, Any]


def save(path: Path, meta: dict[str, Any], points: Sequence[Point]) -> None:
    """Write the results JSON atomically (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    body = {"meta": meta, "points": list(points), "summary": repeat_summary(points)}
    tmp.write_text(json.dumps(body, indent=1) + "\n")
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


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:,.{digits}f}"


def _cell(metric: dict[str, float | None], scale: float = 1.0, digits: int = 0) -> str:
    """The median, then [min-max] when the runs differ at the shown precision."""
    median = _fmt(metric["median"], scale, digits)
    low, high = _fmt(metric["min"], scale, digits), _fmt(metric["max"], scale, digits)
    return median if low == high else f"{median} [{low}-{high}]"


def table(points: Sequence[Point]) -> str:
    """A Markdown table, one row per configuration and point (the order of their first runs);
    values are medians over the runs, with [min-max] (`repeat_summary`)."""
    srcs = sources(points)
    head = ["config", "conv", "prompt tok/s", "output tok/s", "req/s", "TTFT p50 / p95 / p99 (s)",
            "ITL p50 / p99 (ms)", "E2E p50 / p95 / p99 (s)", f"tokens {' / '.join(srcs)}", "reloaded",
            "preempt", "client lag p99 (ms)", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in repeat_summary(points):
        m = row["metrics"]
        conv = str(row["conversations"])
        if row.get("concurrency") is not None:
            conv += f" @{row['concurrency']}"
        cells = [row["config"], conv, _cell(m["prompt_tokens_per_s"]),
                 _cell(m["output_tokens_per_s"], digits=1), _cell(m["requests_per_s"], digits=2),
                 " / ".join(_cell(m[f"ttft_s.p{q}"], digits=2) for q in PERCENTILES),
                 f"{_cell(m['itl_s.p50'], 1000)} / {_cell(m['itl_s.p99'], 1000)}",
                 " / ".join(_cell(m[f"e2e_s.p{q}"], digits=2) for q in PERCENTILES),
                 " / ".join(_cell(m[f"tokens.{s}"]) if f"tokens.{s}" in m else "0" for s in srcs)
                 + ("" if row["tokens_sum_ok"] else " (!)"),
                 _cell(m["reloaded_tokens"]), _cell(m["preemptions"]),
                 _cell(m["client.loop_lag_ms.p99"], digits=1), str(row["runs"])]
        lines.append("| " + " | ".join(cells) + " |")
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
        for metric in ("ttft_s", "itl_s", "e2e_s"):
            for q in PERCENTILES:
                row[f"{metric}_p{q}"] = (p.get(metric) or {}).get(f"p{q}")
        for s in srcs:
            row[f"tokens_{s}"] = p["tokens"].get(s, 0)
        row.update({k: p.get(k) for k in ("reused_tokens", "reloaded_tokens", "preemptions",
                                           "tokens_sum_ok", "tokens_from")})
        row["client_loop_lag_p99_ms"] = client.get("loop_lag_ms", {}).get("p99")
        row["client_cpu_fraction"] = client.get("cpu_fraction")
        ramp, single = p.get("ramp") or {}, p.get("single_use") or {}
        row["ramp_step"], row["ramp_concurrency"] = ramp.get("step"), ramp.get("concurrency")
        row["single_use_requests"] = single.get("requests", 0)
        row["conversation_host_hit"] = single.get("conversation_host_hit")
        row["repeat"] = p.get("repeat", 0)
        row["run"] = p.get("run")
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

    by_config: dict[str, list[dict[str, Any]]] = {}
    summary = repeat_summary(points)
    ramp = any(row["concurrency"] is not None for row in summary)

    def x_of(row: dict[str, Any]) -> int:
        return int(row["concurrency"] if ramp else row["conversations"])

    for row in summary:
        by_config.setdefault(row["config"], []).append(row)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, rows) in enumerate(by_config.items()):
        rows = sorted(rows, key=x_of)
        shift = 1 + 0.02 * (i - (len(by_config) - 1) / 2)
        xs = [x_of(r) * shift for r in rows]
        for ax, metric in ((left, "tokens_per_s"), (right, "ttft_s.p99")):
            spreads = [{k: math.nan if v is None else v for k, v in r["metrics"][metric].items()}
                       for r in rows]
            median = [s["median"] for s in spreads]
            bars = [[m - s["min"] for m, s in zip(median, spreads, strict=True)],
                    [s["max"] - m for m, s in zip(median, spreads, strict=True)]]
            ax.errorbar(xs, median, yerr=bars, marker="o", capsize=3, label=name)
    left.set_ylabel("throughput (prompt + output tokens/s)")
    right.set_ylabel("TTFT p99 (s)")
    right.set_yscale("log")
    plain = matplotlib.ticker.FormatStrFormatter("%g")
    right.yaxis.set_major_formatter(plain)
    right.yaxis.set_minor_formatter(plain)
    ticks = sorted({x_of(row) for row in summary})
    for ax in (left, right):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel(f"{'concurrency (ramp step)' if ramp else 'conversations'} "
                      "(median and min-max over the runs)")
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
