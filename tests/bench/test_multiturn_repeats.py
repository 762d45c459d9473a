"""Interleaved, repeated sweeps: the schedule, the runs in that order on fresh engines, the median
and spread of each metric, the table, the vllm-native configurations and vLLM's own token split."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.multiturn import configs, report, scrape, sweep
from kvtier.bench.multiturn.conversation import WorkloadSpec
from kvtier.bench.multiturn.summary import RequestRecord, point_summary, repeat_summary, spread
from kvtier.bench.multiturn.vllm_server import ServerSettings
from kvtier.cli import main


def test_schedule_interleaves_configurations_point_by_point_in_rotated_rounds() -> None:
    runs = sweep.schedule((2, 4), ["a", "b", "c"], 3)
    assert [(r.conversations, r.repeat, r.config) for r in runs[:9]] == [
        (2, 0, "a"), (2, 0, "b"), (2, 0, "c"),
        (2, 1, "b"), (2, 1, "c"), (2, 1, "a"),
        (2, 2, "c"), (2, 2, "a"), (2, 2, "b")]
    assert [r.index for r in runs] == list(range(18))
    assert all(r.conversations == 4 for r in runs[9:])  # every configuration ran 3 times at 2 first
    assert [r.tag for r in runs if r.config == "a"] == ["n2", "n2r1", "n2r2", "n4", "n4r1", "n4r2"]
    assert [r.config for r in sweep.schedule((8,), ["a", "b"], 1)] == ["a", "b"]
    with pytest.raises(ValueError, match="--repeats 0"):
        sweep.schedule((8,), ["a"], 0)


class FakeEngine:
    """Stands in for `InProcessEngine`: serves instantly and logs each run."""

    log: list[tuple[str, str, bool]] = []

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def warm_up(self) -> None:
        return None

    def run_point(self, spec: WorkloadSpec, tag: str,
                  on_request: Any = None) -> tuple[list[RequestRecord], dict]:
        kvtier = self.settings.kvtier
        fs_dirs = [Path(t["root_dir"]) for t in (kvtier or {}).get("secondary_tiers", [])]
        FakeEngine.log.append((str(self.settings.device_blocks), tag, all(d.is_dir() for d in fs_dirs)))
        record = RequestRecord(0, 1, 0.0, 1.0, 0.5, 100, 2, [0.1], tokens={"device": 40, "recomputed": 60})
        return [record], {}


def test_sweep_runs_each_configuration_on_a_fresh_engine_in_schedule_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.bench.multiturn.engine_run.InProcessEngine", FakeEngine)
    FakeEngine.log = []
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path / "work")
    plan = sweep.Plan(WorkloadSpec(160, 64, 1, 2, 1, 2), (2, 4), ["no-offload", "host+fs", "all-fits"],
                      "inprocess", tmp_path, "m", None, 32, 1 << 20, 1024, ctx, repeats=2)
    points: list[dict[str, Any]] = []
    sweep.run_sweep(plan, sweep.Hooks(), points.append)
    order = [(p["conversations"], p["repeat"], p["config"]) for p in points]
    assert order == [(r.conversations, r.repeat, r.config) for r in sweep.schedule((2, 4), plan.configs, 2)]
    assert [p["run"] for p in points] == list(range(12))
    assert all(len(p["loadavg"]) == 3 for p in points)
    assert [entry[0] for entry in FakeEngine.log[:3]] == ["40", "40", "400"]
    assert [entry[1] for entry in FakeEngine.log[:6]] == ["n2"] * 3 + ["n2r1"] * 3
    assert all(entry[2] for entry in FakeEngine.log)  # the fs tier's directory existed during its run
    assert not any((tmp_path / "work").iterdir())  # and every run's directory is gone afterwards


def _run(config: str, tput: float, p99: float, repeat: int, tokens: dict[str, int]) -> dict[str, Any]:
    record = RequestRecord(0, 1, 0.0, 1.0, p99, int(tput), 1, [0.05])
    return point_summary(config, 8, [record], tokens, {"repeat": repeat, "run": repeat})


def test_median_and_spread_over_repeats() -> None:
    s = spread([3.0, 1.0, 2.0, math.nan])
    assert (s.median, s.low, s.high, s.runs) == (2.0, 1.0, 3.0, 3)
    assert spread([4.0, 1.0, 2.0, 10.0]).median == 3.0
    assert spread([math.nan]).runs == 0 and math.isnan(spread([]).median)
    points = [_run("host", t, 0.1 * t / 100, r, {"device": 10, "host": h, "recomputed": int(t) - 10 - h})
              for r, (t, h) in enumerate([(500.0, 300), (700.0, 200), (600.0, 250)])]
    points.insert(1, _run("no-offload", 100.0, 2.0, 0, {"device": 10, "recomputed": 90}))
    rows = repeat_summary(points)
    assert [(r["config"], r["runs"]) for r in rows] == [("host", 3), ("no-offload", 1)]
    host = rows[0]["metrics"]
    assert host["prompt_tokens_per_s"] == {"median": 600.0, "min": 500.0, "max": 700.0, "runs": 3}
    assert host["tokens.host"]["median"] == 250 and host["tokens.host"]["min"] == 200
    assert host["tokens_per_s"]["median"] == 601.0  # prompt + output tokens per second
    assert host["ttft_s.p99"]["max"] == pytest.approx(0.7)
    assert host["preemptions"] == {"median": None, "min": None, "max": None, "runs": 0}  # not measured
    table = report.table(points)
    assert "| host | 8 | 600 [500-700] | 1.0 |" in table
    assert "| no-offload | 8 | 100 | 1.0 |" in table and table.count("\n") == 3
    assert " 10 / 250 [200-300] / 340 [190-490] |" in table and table.rstrip().endswith("| 1 |")


def test_results_keep_every_run_and_the_summary(tmp_path: Path) -> None:
    points = [_run(c, 100.0 * (r + 1), 0.5, r, {"device": 0, "recomputed": 100 * (r + 1)})
              for r in range(3) for c in ("host", "vllm-native")]
    paths = report.write_all(tmp_path, {"title": "t"}, points)
    saved = json.loads(paths["json"].read_text())
    assert saved["points"] == points
    assert saved["summary"] == repeat_summary(points)
    assert saved["summary"][1]["metrics"]["prompt_tokens_per_s"]["max"] == 300.0
    assert paths["csv"].read_text().splitlines()[0].endswith(",repeat,run")
    assert paths["png"].stat().st_size > 10_000


def test_vllm_native_configurations_match_kvtiers_sizes(tmp_path: Path) -> None:
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path)
    native, host = configs.resolve("vllm-native", ctx), configs.resolve("host", ctx)
    assert native.kvtier is None and native.device_blocks == host.device_blocks
    assert native.connector == configs.native_connector_config({**configs.NATIVE_SPEC, **(host.kvtier or {})})
    native_fs, host_fs = configs.resolve("vllm-native+fs", ctx), configs.resolve("host+fs", ctx)
    assert native_fs.connector is not None and host_fs.kvtier is not None
    native_extra = native_fs.connector["kv_connector_extra_config"]
    assert native_extra["cpu_bytes_to_use"] == host_fs.kvtier["cpu_bytes_to_use"]
    fs_dir = Path(native_extra["secondary_tiers"][0]["root_dir"])
    assert fs_dir.is_dir() and fs_dir != Path(host_fs.kvtier["secondary_tiers"][0]["root_dir"])
    root = configs.baselines_root()
    assert (root / "benchmarks" / "baselines" / "vllm_native.py").is_file()
    settings = ServerSettings(tmp_path, "m", 32, 40, 1024, 4, 1 << 20, connector=native.connector)
    transfer = settings.kv_transfer_config()
    assert transfer is not None and transfer["kv_connector"] == "OffloadingConnector"
    assert transfer["kv_connector_extra_config"]["spec_module_path"] == "benchmarks.baselines.vllm_native"
    assert "--kv-transfer-config" in settings.argv(8000)
    assert settings.env(tmp_path)["PYTHONPATH"].split(":")[0] == str(root)
    kvtier = ServerSettings(tmp_path, "m", 32, 40, 1024, 4, 1 << 20, kvtier=host.kvtier)
    assert (kvtier.kv_transfer_config() or {})["kv_connector"] == "KVTierConnector"
    assert ServerSettings(tmp_path, "m", 32, 40, 1024, 4, 1 << 20).kv_transfer_config() is None


def test_lmcache_configurations_match_kvtiers_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = configs.importlib.util.find_spec  # building a configuration needs no LMCache installed
    monkeypatch.setattr(configs.importlib.util, "find_spec",
                        lambda name, *a: real("json") if name == "lmcache" else real(name, *a))
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path, block_size=32)
    lmcache, host = configs.resolve("lmcache", ctx), configs.resolve("host", ctx)
    assert lmcache.kvtier is None and lmcache.device_blocks == host.device_blocks
    assert lmcache.connector is not None
    assert lmcache.connector["kv_connector_module_path"] == "benchmarks.baselines.lmcache_cpu"
    extra = lmcache.connector["kv_connector_extra_config"]
    assert extra["lmcache.chunk_size"] == 32  # one engine block per LMCache chunk
    assert extra["lmcache.max_local_cpu_size"] * (1 << 30) == (host.kvtier or {})["cpu_bytes_to_use"]
    assert extra["lmcache.local_disk"] is None and extra["lmcache.max_local_disk_size"] == 0
    disk = configs.resolve("lmcache+disk", ctx).connector
    assert disk is not None
    disk_extra = disk["kv_connector_extra_config"]
    assert disk_extra["lmcache.max_local_cpu_size"] == extra["lmcache.max_local_cpu_size"]
    assert disk_extra["lmcache.max_local_disk_size"] * (1 << 30) == 400 * (1 << 20)
    assert disk_extra["lmcache.local_disk"].startswith("file://")
    assert Path(disk_extra["lmcache.local_disk"][len("file://"):]).is_dir()
    with pytest.raises(ValueError, match="block size"):
        configs.resolve("lmcache", configs.BenchContext(1 << 20, 40, 400, 80, tmp_path))


def test_a_missing_lmcache_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = configs.importlib.util.find_spec
    monkeypatch.setattr(configs.importlib.util, "find_spec",
                        lambda name, *a: None if name == "lmcache" else real(name, *a))
    with pytest.raises(ValueError, match=r"lmcache\+disk: needs the package lmcache.*install_lmcache\.sh"):
        configs.check_names(["host", "lmcache+disk"])
    configs.check_names(["host", "vllm-native"])


def test_missing_baselines_are_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(configs, "BASELINES", "benchmarks.nowhere")
    for name in ("vllm-native", "lmcache"):
        with pytest.raises(ValueError, match=r"need the baselines benchmarks\.nowhere.*PYTHONPATH"):
            configs.check_names(["host", name])
    configs.check_names(["host", "all-fits"])


NATIVE_BEFORE = """vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 900.0
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 100.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 0.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="disk"} 0.0
"""


def test_native_split_separates_vllms_host_and_disk_reloads() -> None:
    after = (NATIVE_BEFORE.replace('"local_cache_hit"} 100.0', '"local_cache_hit"} 164.0')
             .replace('"local_compute"} 900.0', '"local_compute"} 1100.0')
             .replace('"external_kv_transfer"} 0.0', '"external_kv_transfer"} 768.0')
             .replace('"host"} 0.0', '"host"} 512.0').replace('"disk"} 0.0', '"disk"} 256.0'))
    before = scrape.parse(NATIVE_BEFORE)
    split = sweep.native_split(before, scrape.parse(after))
    assert split == {"device": 64, "host": 512, "fs": 256, "recomputed": 200}
    assert list(split) == ["device", "host", "fs", "recomputed"]
    host_only = after.replace('"disk"} 256.0', '"disk"} 0.0')
    assert sweep.native_split(before, scrape.parse(host_only)) == {"device": 64, "host": 768,
                                                                   "recomputed": 200}
    no_connector = NATIVE_BEFORE.replace('"local_compute"} 900.0', '"local_compute"} 1000.0')
    assert sweep.native_split(before, scrape.parse(no_connector)) == scrape.vllm_split(
        before, scrape.parse(no_connector)) == {"device": 0, "recomputed": 100}


def test_repeats_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "multiturn", "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err
