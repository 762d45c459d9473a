"""`kvtier bench multiturn --trace DIR`: every kvtier configuration traces its run to its own file."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench.multiturn import configs


def test_each_kvtier_run_gets_its_own_trace_file(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "run3-host", {"trace_dir": str(traces)})
    host = configs.resolve("host", ctx).kvtier
    assert host is not None and host["trace_path"] == str(traces / "run3-host.jsonl")
    assert configs.resolve("no-offload", ctx).kvtier is None
    plain = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "run3-host")
    untraced = configs.resolve("host", plain).kvtier
    assert untraced is not None and "trace_path" not in untraced
