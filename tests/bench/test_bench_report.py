"""`kvtier bench report` with no files redraws BENCHMARKS.md's plots from the committed raw JSON,
and a raw JSON that lacks what a plot needs is an error naming the file."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from kvtier.bench import results_page as plots
from kvtier.cli import main
from kvtier.errors import KVTierError

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, read from its IHDR chunk; AssertionError if it is none."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path} has no IHDR chunk first"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def page_inputs(tmp_path: Path) -> Path:
    """A copy of the raw JSON files the page's plots read."""
    copy = tmp_path / "results"
    copy.mkdir()
    for run in (*(r for regime in plots.REGIMES for r in regime.runs), plots.RAMP):
        shutil.copy(RESULTS / run.file, copy / run.file)
    return copy


def test_the_report_draws_both_plots_from_the_committed_json(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    assert main(["bench", "report", "--results-dir", str(RESULTS), "--out", str(out)]) == 0
    for name in ("regimes.png", "ramp.png"):
        width, height = png_size(out / name)
        assert width >= 800 and height >= 400


def test_the_regime_figures_are_the_pages(tmp_path: Path) -> None:
    """The plot's kvtier medians are the ones BENCHMARKS.md quotes, and every system is drawn."""
    figures = dict(plots.regime_figures(RESULTS))
    host = dict(figures["host tier holds the working set (8 conversations)"])
    fs = dict(figures["only fs holds it (16 conversations)"])
    assert [round(f["kvtier"]["median"]) for f in host.values()] == [3056, 3012]
    assert [round(f["kvtier"]["median"]) for f in fs.values()] == [2873, 2993]
    for regime in (host, fs):
        drawn = {system for f in regime.values() for system in f}
        assert drawn == set(plots.SYSTEMS)
        assert all(f[s]["min"] <= f[s]["median"] <= f[s]["max"] for f in regime.values() for s in f)


def test_a_regime_missing_from_the_json_names_the_file(tmp_path: Path) -> None:
    results = page_inputs(tmp_path)
    broken = results / plots.REGIMES[1].runs[1].file
    body = json.loads(broken.read_text())
    body["points"] = [p for p in body["points"] if p["config"] != "host+fs"]
    broken.write_text(json.dumps(body))
    with pytest.raises(KVTierError, match=rf"{broken}: no run of 'host\+fs' at 16 conversations"):
        plots.draw_page(results, tmp_path / "plots")


def test_a_file_of_another_regime_names_the_file(tmp_path: Path) -> None:
    """The host regime's file put where the fs regime's is expected: no run at 16 conversations."""
    results = page_inputs(tmp_path)
    wrong = results / plots.REGIMES[1].runs[0].file
    shutil.copy(RESULTS / plots.REGIMES[0].runs[0].file, wrong)
    with pytest.raises(KVTierError, match=rf"{wrong}: no run of 'host\+fs' at 16 conversations"):
        plots.regime_figures(results)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    results = page_inputs(tmp_path)
    (results / plots.RAMP.file).unlink()
    with pytest.raises(KVTierError, match=rf"{results / plots.RAMP.file}: no such results file"):
        plots.ramp_figures(results)
