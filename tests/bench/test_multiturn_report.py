"""The benchmark's math and records: percentiles, per-point summaries whose token split adds up to
the prompt tokens, /metrics deltas, presets and configurations, and the saved results redrawn."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from kvtier.bench.multiturn import configs, presets, report, scrape
from kvtier.bench.multiturn.summary import RequestRecord, percentile, point_summary, sum_splits, summary
from kvtier.cli import main


def test_percentiles_match_linear_interpolation() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert math.isnan(percentile([], 50))
    rng = random.Random(3)
    values = [rng.expovariate(1.0) for _ in range(101)]
    for q in (50, 95, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert summary([1, 2, 3, 4])["mean"] == 2.5
    with pytest.raises(ValueError, match="percentile 101"):
        percentile([1], 101)


def _record(conv: int, turn: int, start: float, end: float, ttft: float, prompt: int,
            itl: list[float], error: str = "") -> RequestRecord:
    return RequestRecord(conv, turn, start, end, ttft, prompt, len(itl) + 1, list(itl), error=error)


def test_point_summary_throughput_percentiles_and_split() -> None:
    records = [_record(0, 1, 10.0, 11.0, 0.5, 300, [0.1, 0.1]),
               _record(1, 1, 10.0, 12.0, 1.5, 300, [0.2, 0.3]),
               _record(0, 2, 11.0, 14.0, 0.25, 400, [0.1]),
               _record(1, 2, 12.0, 13.0, 9.0, 0, [], error="HTTP 500")]
    split = {"device": 100, "host": 300, "fs": 200, "recomputed": 400}
    point = point_summary("host+fs", 2, records, split, {"preemptions": 0})
    assert point["duration_s"] == 4.0  # first start 10 s to last end 14 s
    assert point["prompt_tokens"] == 1000 and point["prompt_tokens_per_s"] == 250.0
    assert point["output_tokens"] == 3 + 3 + 2 and point["output_tokens_per_s"] == 2.0
    assert point["requests"] == 3 and point["failed_requests"] == 1 and point["requests_per_s"] == 0.75
    assert point["ttft_s"]["p50"] == 0.5 and point["ttft_s"]["p99"] == pytest.approx(1.48)
    assert point["itl_s"]["p50"] == 0.1
    assert point["tokens"] == split and point["tokens_sum_ok"]
    assert point["reused_tokens"] == 600 and point["reloaded_tokens"] == 500
    assert list(point["tokens"]) == ["device", "host", "fs", "recomputed"]
    bad = point_summary("host", 2, records, {**split, "recomputed": 399})
    assert not bad["tokens_sum_ok"]
    # Tokens a tier held that `load_policy: auto` recomputed are neither reused nor reloaded.
    chosen = point_summary("host+fs", 2, records, {**split, "fs": 50, "recomputed_by_choice": 150})
    assert chosen["reused_tokens"] == 450 and chosen["reloaded_tokens"] == 350


def test_request_splits_sum_to_the_prompt_tokens() -> None:
    splits = [{"device": 64, "host": 128, "recomputed": 30}, {"recomputed": 200, "device": 0},
              {"device": 32, "host": 0, "fs": 256, "recomputed": 10}]
    total = sum_splits(splits)
    assert total == {"device": 96, "host": 128, "fs": 256, "recomputed": 240}
    assert next(iter(total)) == "device" and list(total)[-1] == "recomputed"
    assert sum(total.values()) == 64 + 128 + 30 + 200 + 32 + 256 + 10


METRICS_BEFORE = """# HELP kvtier_prompt_tokens_total Prompt tokens by where their KV came from
# TYPE kvtier_prompt_tokens_total counter
kvtier_prompt_tokens_total{engine="0",model_name="m",source="device"} 100.0
kvtier_prompt_tokens_total{engine="0",model_name="m",source="host"} 0.0
kvtier_prompt_tokens_total{engine="0",model_name="m",source="fs"} 0.0
kvtier_prompt_tokens_total{engine="0",model_name="m",source="recomputed"} 900.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 900.0
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
kvtier_transfer_seconds_total{engine="0",model_name="m",op="load",tier="host"} 1.5
kvtier_transfer_bytes_total{engine="0",model_name="m",op="load",tier="host"} 1000.0
"""
METRICS_AFTER = METRICS_BEFORE.replace('"device"} 100.0', '"device"} 164.0').replace(
    '"host"} 0.0', '"host"} 512.0').replace('"fs"} 0.0', '"fs"} 256.0').replace(
    '"recomputed"} 900.0', '"recomputed"} 1100.0').replace(
    '"local_cache_hit"} 100.0', '"local_cache_hit"} 164.0').replace(
    '"local_compute"} 900.0', '"local_compute"} 1868.0').replace("} 1.0", "} 3.0")


def test_metrics_deltas_give_the_split() -> None:
    before, after = scrape.parse(METRICS_BEFORE), scrape.parse(METRICS_AFTER)
    split = scrape.kvtier_split(before, after)
    assert split == {"device": 64, "host": 512, "fs": 256, "recomputed": 200}
    assert list(split) == ["device", "host", "fs", "recomputed"]
    assert scrape.vllm_split(before, after) == {"device": 64, "recomputed": 968}
    assert scrape.preemptions(before, after) == 2
    moved = scrape.transfers(before, scrape.parse(METRICS_AFTER.replace("} 1.5", "} 2.0").replace(
        "} 1000.0", "} 5000.0")))
    assert moved == {"host.load": {"seconds": 0.5, "bytes": 4000.0}}
    two_engines = METRICS_AFTER + METRICS_AFTER.replace('engine="0"', 'engine="1"')
    assert scrape.by_label(scrape.parse(two_engines), scrape.KVTIER_TOKENS, "source")["host"] == 1024


def test_presets_size_the_caches() -> None:
    cpu = presets.preset("cpu")
    sizes = presets.sizing(cpu, cpu.workload, cpu.sweep)
    assert sizes.device_blocks == presets.DEVICE_CONVERSATIONS * sizes.blocks_per_conversation
    assert sizes.host_chunks == 2 * sizes.device_blocks
    assert sizes.all_fits_blocks >= max(cpu.sweep) * sizes.blocks_per_conversation
    assert sizes.max_model_len % cpu.block_size == 0
    assert sizes.max_model_len >= cpu.workload.max_prompt_tokens() + cpu.workload.output_tokens
    mini = presets.preset("mini")
    m = presets.sizing(mini, mini.workload, mini.sweep)
    assert (m.device_blocks, mini.block_size, mini.workload.max_concurrency) == (64, 128, 4)
    assert m.host_chunks >= 16 * m.blocks_per_conversation  # the host tier holds everything
    with pytest.raises(ValueError, match="--device-blocks 3"):
        presets.sizing(mini, mini.workload, mini.sweep, device_blocks=3)
    with pytest.raises(ValueError, match="--device-blocks"):
        presets.sizing(presets.preset("paper"), presets.PRESETS["paper"].workload, (16,))
    with pytest.raises(ValueError, match=r"--preset nope.*mini"):
        presets.preset("nope")


def test_kv_bytes_per_token_counts_attention_layers_only(tmp_path: Path) -> None:
    import json

    base = {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64}
    hybrid = {**base, "layer_types": ["linear_attention", "full_attention", "mamba", "sliding_attention"]}
    for name, config in (("plain", base), ("hybrid", hybrid)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert presets.kv_bytes_per_token(tmp_path / "plain", "bfloat16") == 4 * 2 * 2 * 64 * 2
    assert presets.kv_bytes_per_token(tmp_path / "hybrid", "float32") == 2 * 2 * 2 * 64 * 4


def test_configurations_by_name(tmp_path: Path) -> None:
    ctx = configs.BenchContext(block_bytes=1 << 20, device_blocks=40, all_fits_blocks=400,
                               host_chunks=80, work_dir=tmp_path)
    assert configs.resolve("no-offload", ctx) == configs.EngineConfig("no-offload", 40, None)
    assert configs.resolve("all-fits", ctx).device_blocks == 400
    host = configs.resolve("host", ctx).kvtier
    assert host == {"cpu_bytes_to_use": 80 << 20, "eviction_policy": "lru"}
    fs = configs.resolve("host+fs", ctx).kvtier
    assert fs is not None and fs["secondary_tiers"][0]["type"] == "fs"
    assert Path(fs["secondary_tiers"][0]["root_dir"]).is_dir()
    with pytest.raises(ValueError, match="needs --redis-url"):
        configs.resolve("redis", ctx)
    with pytest.raises(ValueError, match="needs --obj-endpoint"):
        configs.resolve("obj", ctx)
    with pytest.raises(ValueError, match=r"unknown configuration 'hots'.*host\+fs"):
        configs.check_names(["host", "hots"])
    redis = configs.resolve("redis", configs.BenchContext(1 << 20, 40, 400, 80, tmp_path,
                                                          {"redis_url": "redis://127.0.0.1:1"}))
    assert redis.kvtier is not None and redis.kvtier["secondary_tiers"][0]["url"] == "redis://127.0.0.1:1"


def _point(config: str, conversations: int, tput: float, p99: float) -> dict:
    records = [_record(0, 1, 0.0, 1.0, p99, int(tput), [0.05])]
    return point_summary(config, conversations, records, {"device": 0, "host": int(tput) // 2,
                                                          "recomputed": int(tput) - int(tput) // 2})


def test_results_saved_loaded_and_redrawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    points = [_point(c, n, 1000.0 / n * (2 if c == "host" else 1), 0.1 * n)
              for c in ("no-offload", "host") for n in (2, 4, 8)]
    paths = report.write_all(tmp_path / "a", {"label": "box-a", "title": "t"}, points)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(paths["csv"].open()))
    assert len(rows) == 6 and rows[0]["ttft_s_p99"] and rows[0]["tokens_host"] == "250"
    assert json.loads(paths["json"].read_text())["points"] == points
    table = report.table(points)
    assert "| host | 4 | 500 |" in table and "tokens device / host / recomputed" in table
    report.save(tmp_path / "b" / "results.json", {"label": "box-b"}, points[:3])
    metas, loaded = report.load([paths["json"], tmp_path / "b" / "results.json"])
    assert [m["label"] for m in metas] == ["box-a", "box-b"]
    assert {p["config"] for p in loaded} == {"box-a: no-offload", "box-a: host", "box-b: no-offload"}
    assert main(["bench", "report", str(paths["json"]), "--out", str(tmp_path / "r")]) == 0
    assert "| no-offload | 8 | 125 |" in capsys.readouterr().out
    assert (tmp_path / "r" / "report.png").stat().st_size > 10_000
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "report", str(tmp_path / "bad.json")]) == 2
    assert "not a results file" in capsys.readouterr().err


def test_bad_flags_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "multiturn", "--preset", "nope"]) == 2
    assert "--preset nope" in capsys.readouterr().err
    assert main(["bench", "multiturn", "--configs", "host,nope"]) == 2
    assert "unknown configuration 'nope'" in capsys.readouterr().err
    assert main(["bench", "multiturn", "--preset", "smoke", "--turns", "0"]) == 2
    assert "--turns 0" in capsys.readouterr().err
