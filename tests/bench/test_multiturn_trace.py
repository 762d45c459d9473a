"""`kvtier bench multiturn --trace DIR`: every kvtier configuration traces its run to its own file;
`--blocks-per-chunk N`: every kvtier configuration offloads in chunks of N engine blocks;
`--load-policy P`: every kvtier configuration loads or recomputes by `load_policy` P."""

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


def test_blocks_per_chunk_option_sets_kvtier_chunk_size_only(tmp_path: Path) -> None:
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "run1", {"blocks_per_chunk": "4"})
    for name in ("host", "host+fs"):
        kv = configs.resolve(name, ctx).kvtier
        assert kv is not None and kv["blocks_per_chunk"] == 4
        assert kv["cpu_bytes_to_use"] == 80 << 20  # the host tier keeps its bytes
    assert configs.resolve("no-offload", ctx).kvtier is None
    default = configs.resolve("host", configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "run2")).kvtier
    assert default is not None and "blocks_per_chunk" not in default


def test_load_policy_option_sets_every_kvtier_configuration_only(tmp_path: Path) -> None:
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "run1", {"load_policy": "auto"})
    for name in ("host", "host+fs"):
        kv = configs.resolve(name, ctx).kvtier
        assert kv is not None and kv["load_policy"] == "auto"
    assert configs.resolve("no-offload", ctx).kvtier is None
    default = configs.resolve("host+fs", configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "run2")).kvtier
    assert default is not None and "load_policy" not in default
