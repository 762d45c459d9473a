"""PNG plots of a plan: the host tier's miss-ratio curves and the reuse-time CDF.

matplotlib is imported here, lazily, only when plots are asked for (`kvtier plan --out`); without
it the plan is written without plots and the caller is told why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GIB = 1 << 30
CDF_POINTS = 1000


def write_plots(report: dict[str, Any], reuse_times: np.ndarray, out: Path) -> list[Path]:
    """Write `mrc.png` and `reuse_time_cdf.png` into `out`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, points in report["mrc"].items():
        xs = [b / GIB for b, _ in points]
        ax.plot(xs, [1.0 - h for _, h in points], marker=".", label=policy.upper())
    rec = report["recommend"]
    for key in ("cpu_bytes_to_use", "max_bytes"):
        ax.axvline(rec[key] / GIB, linestyle="--", color="grey")
        ax.annotate(key, (rec[key] / GIB, 0.95), rotation=90, fontsize=7, va="top")
    ax.set_xlabel("host tier size (GiB)")
    ax.set_ylabel("miss ratio")
    ax.set_ylim(0, 1)
    ax.set_title("miss-ratio curve of the host tier")
    ax.legend()
    fig.tight_layout()
    written.append(out / "mrc.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    if len(reuse_times):
        levels = np.linspace(0.0, 1.0, min(len(reuse_times), CDF_POINTS))
        ax.plot(np.quantile(reuse_times, levels), levels)
    ax.set_xlabel("seconds from a chunk's creation to its reuse")
    ax.set_ylabel("fraction of reuses")
    ax.set_title("reuse-time CDF")
    fig.tight_layout()
    written.append(out / "reuse_time_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written
