"""`kvtier bench report` with no results files: BENCHMARKS.md's plots, redrawn from the raw JSON.

Two PNGs, each from files in `benchmarks/results/` (`--results-dir`), written to `docs/bench/`
(`--out`):

- `regimes.png`: prompt tokens/s where the host tier holds the working set and where only fs holds
  it, one panel per regime, kvtier beside vLLM's own tiering, LMCache and all-fits (vLLM alone with
  a device cache that holds everything). Each regime was measured in two runs of the same workload
  (`REGIMES`: the regime comparison against all-fits, then the one with LMCache); each run is a
  marker per system, its median over the rounds, with the min-max spread as its bar.
- `ramp.png`: TTFT p50, TTFT p99, ITL p99 and tokens/s (prompt + output) against the requests in
  flight, one line per configuration, median and min-max over the rounds (`RAMP`).

The figures come from each file's `points` (one per run), summarised as `kvtier bench multiturn`
summarises them (`summary.repeat_summary`). A file that is missing, or that holds no run of a
configuration the plot needs at the regime's number of conversations, is an error naming the file.
With results files, `kvtier bench report FILE...` is multiturn's report of those runs instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.multiturn import report
from kvtier.bench.multiturn.summary import repeat_summary
from kvtier.errors import KVTierError

RESULTS_DIR = Path("benchmarks/results")
PAGE_DIR = Path("docs/bench")
FILES_OUT = Path("bench-results/report")
SYSTEMS = ("kvtier", "vLLM's tiering", "LMCache", "all-fits")
MODEL = "SmolLM2-135M float32 on vLLM's CPU backend, cpu preset (384 + 128 tokens x 6 turns)"


@dataclass(frozen=True)
class Run:
    """One raw JSON file behind a plot, what the run was for, and the configuration each system
    (or line) ran as."""

    file: str
    role: str
    configs: Mapping[str, str]


@dataclass(frozen=True)
class Regime:
    """A panel of `regimes.png`: its title, its number of conversations and the runs drawn."""

    title: str
    conversations: int
    runs: tuple[Run, ...]


REGIME_RUN = "against all-fits"
LMCACHE_RUN = "with LMCache"
REGIMES = (
    Regime("host tier holds the working set (8 conversations)", 8, (
        Run("multiturn_cpu8_host_fits_populated_region_2026-12-03.json", REGIME_RUN,
            {"kvtier": "host", "vLLM's tiering": "vllm-native", "all-fits": "all-fits"}),
        Run("multiturn_cpu8_host_fits_lmcache_2026-12-03.json", LMCACHE_RUN,
            {"kvtier": "host", "vLLM's tiering": "vllm-native", "LMCache": "lmcache",
             "all-fits": "all-fits"}),
    )),
    Regime("only fs holds it (16 conversations)", 16, (
        Run("multiturn_cpu16_fs_populated_region_2026-12-03.json", REGIME_RUN,
            {"kvtier": "host+fs", "vLLM's tiering": "vllm-native+fs", "all-fits": "all-fits"}),
        Run("multiturn_cpu16_fs_lmcache_2026-12-03.json", LMCACHE_RUN,
            {"kvtier": "host+fs", "vLLM's tiering": "vllm-native+fs", "LMCache": "lmcache+disk",
             "all-fits": "all-fits"}),
    )),
)
RAMP = Run("ramp_1_2_4_8_cpu_2026-12-02.json", "concurrency ramp",
           {"vLLM alone (no-offload)": "no-offload", "kvtier, host tier (host)": "host",
            "kvtier, host and fs tiers (host+fs)": "host+fs"})
RAMP_PANELS = (("ttft_s.p50", "TTFT p50 (s)"), ("ttft_s.p99", "TTFT p99 (s)"),
               ("itl_s.p99", "ITL p99 (s)"), ("tokens_per_s", "tokens/s (prompt + output)"))

Spread = dict[str, float]


def _load(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A results file's meta and its summary rows; a KVTierError naming the file otherwise."""
    if not path.is_file():
        raise KVTierError(f"{path}: no such results file (kvtier bench report reads it)")
    try:
        (meta,), points = report.load([path])
    except ValueError as e:
        raise KVTierError(str(e)) from e
    return meta, repeat_summary(points)


def _rows(path: Path, rows: list[dict[str, Any]], config: str, what: str,
          conversations: int | None = None) -> list[dict[str, Any]]:
    """The summary rows of `config` (at `conversations`, when given); an error naming the file
    and what it lacks when there is none."""
    found = [r for r in rows if r["config"] == config
             and (conversations is None or r["conversations"] == conversations)]
    if not found:
        held = sorted({f"{r['config']} at {r['conversations']} conversations" for r in rows})
        at = f" at {conversations} conversations" if conversations is not None else ""
        raise KVTierError(f"{path}: no run of {config!r}{at} ({what}); it holds: "
                          f"{', '.join(held) or 'no runs'}")
    return found


def _spread(row: dict[str, Any], metric: str) -> Spread:
    values = row["metrics"][metric]
    return {k: float(values[k]) for k in ("median", "min", "max")}


def _run_label(run: Run, meta: dict[str, Any], sep: str) -> str:
    """What the run was for, its rounds and start (from its meta), then `sep` and its file."""
    return (f"{run.role}: {meta.get('repeats', '?')} rounds, started "
            f"{str(meta.get('started', '?'))[:16]}{sep}{run.file}")


def regime_figures(results: Path) -> list[tuple[str, list[tuple[str, dict[str, Spread]]]]]:
    """Per regime, its title and per run its label and prompt tokens/s spread by system."""
    out = []
    for regime in REGIMES:
        runs = []
        for run in regime.runs:
            path = results / run.file
            meta, rows = _load(path)
            figures = {system: _spread(_rows(path, rows, config, f"{system}, {regime.title}",
                                             regime.conversations)[0], "prompt_tokens_per_s")
                       for system, config in run.configs.items()}
            runs.append((_run_label(run, meta, "\n"), figures))
        out.append((regime.title, runs))
    return out


def ramp_figures(results: Path) -> tuple[str, dict[str, dict[str, dict[int, Spread]]]]:
    """The run's label, and per configuration label, per panel metric, the spread at each number
    in flight."""
    path = results / RAMP.file
    meta, rows = _load(path)
    out: dict[str, dict[str, dict[int, Spread]]] = {}
    for label, config in RAMP.configs.items():
        steps = [r for r in _rows(path, rows, config, "the ramp") if r["concurrency"] is not None]
        if not steps:
            raise KVTierError(f"{path}: {config!r} has no ramp steps (the ramp)")
        out[label] = {metric: {int(r["concurrency"]): _spread(r, metric) for r in steps}
                      for metric, _ in RAMP_PANELS}
    return _run_label(RAMP, meta, ", "), out


def _errorbar(ax: Any, xs: Sequence[float], spreads: Sequence[Spread], **style: Any) -> None:
    medians = [s["median"] for s in spreads]
    bars = [[m - s["min"] for m, s in zip(medians, spreads, strict=True)],
            [s["max"] - m for m, s in zip(medians, spreads, strict=True)]]
    ax.errorbar(xs, medians, yerr=bars, capsize=4, **style)


def draw_regimes(results: Path, path: Path) -> None:
    """`regimes.png` (see the module docstring)."""
    import matplotlib.pyplot as plt

    regimes = regime_figures(results)
    fig, axes = plt.subplots(1, len(regimes), figsize=(12, 6), sharey=True)
    for ax, (title, runs) in zip(axes, regimes, strict=True):
        for i, (label, figures) in enumerate(runs):
            shift = 0.2 * (i - (len(runs) - 1) / 2)
            side = -1 if shift < 0 else 1
            shown = [s for s in SYSTEMS if s in figures]
            xs = [SYSTEMS.index(s) + shift for s in shown]
            _errorbar(ax, xs, [figures[s] for s in shown], fmt="o", color=f"C{i}", label=label)
            for x, s in zip(xs, shown, strict=True):
                ax.annotate(f"{figures[s]['median']:,.0f}", (x, figures[s]["median"]),
                            xytext=(7 * side, 0), textcoords="offset points", va="center",
                            ha="right" if side < 0 else "left", fontsize=8)
        ax.set_xticks(range(len(SYSTEMS)), SYSTEMS)
        ax.set_xlim(-0.6, len(SYSTEMS) - 0.4)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize=8,
                  title="run (raw JSON in benchmarks/results/)", title_fontsize=8)
    axes[0].set_ylabel("prompt tokens/s (median; bar: min-max over the rounds)")
    fig.suptitle(f"kvtier against vLLM's tiering, LMCache and all-fits, by regime\n{MODEL}",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def draw_ramp(results: Path, path: Path) -> None:
    """`ramp.png` (see the module docstring)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    run_label, lines = ramp_figures(results)
    fig, grid = plt.subplots(2, len(RAMP_PANELS) // 2, figsize=(11, 8.5))
    axes = list(grid.flat)
    levels = sorted({n for per in lines.values() for n in per[RAMP_PANELS[0][0]]})
    for i, (label, per_metric) in enumerate(lines.items()):
        for ax, (metric, _) in zip(axes, RAMP_PANELS, strict=True):
            steps = per_metric[metric]
            xs = sorted(steps)
            shifted = [x * (1 + 0.03 * (i - (len(lines) - 1) / 2)) for x in xs]
            _errorbar(ax, shifted, [steps[x] for x in xs], fmt="-o", color=f"C{i}", label=label)
    for ax, (_, ylabel) in zip(axes, RAMP_PANELS, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.xaxis.set_minor_formatter(FormatStrFormatter(""))
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Concurrency ramp, 8 conversations (the device holds 4, the host tier all 8): "
                 f"median, bar min-max over the rounds\n{MODEL}\n{run_label}",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def draw_page(results: Path, out: Path) -> list[Path]:
    """Both PNGs into `out`, from the files in `results`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    written = [out / "regimes.png", out / "ramp.png"]
    draw_regimes(results, written[0])
    draw_ramp(results, written[1])
    return written


def run_report(args: argparse.Namespace) -> int:
    """`kvtier bench report`: the results page's plots, or multiturn's report of the files given."""
    if args.results:
        args.out = args.out or FILES_OUT
        return report_files(args)
    written = draw_page(args.results_dir, args.out or PAGE_DIR)
    print(f"plots: {', '.join(str(p) for p in written)}")
    return 0


def report_files(args: argparse.Namespace) -> int:
    try:
        metas, points = report.load(args.results)
    except ValueError as e:
        raise KVTierError(str(e)) from e
    title = args.title or (metas[0].get("title", "kvtier bench multiturn") if len(metas) == 1
                           else "kvtier bench multiturn: " + ", ".join(str(m.get("label")) for m in metas))
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_csv(args.out / "report.csv", points)
    if points:
        report.plot(args.out / "report.png", points, title)
    print(report.table(points))
    print(f"report: {args.out / 'report.csv'}, {args.out / 'report.png'}", file=sys.stderr)
    return 0
