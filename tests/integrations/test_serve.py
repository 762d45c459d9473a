"""`kvtier serve`: the kv-transfer-config built from its flags (and from a config written for vLLM's
OffloadingConnector, the seeds' own among them), the vLLM flags it adds on CPU (device cache size,
eager mode) while the user's own win, the memory plan on a machine of a chosen size, bad flags and
keys refused before vLLM starts naming them. A real server started this way, with no device-memory
flag: `test_shutdown.py`, whose servers it shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.errors import KVTierError
from kvtier.integrations.vllm.serving import serve, startup
from kvtier.integrations.vllm.serving.launch import CONNECTOR
from kvtier.integrations.vllm.serving.serve import build_transfer_config
from tests.host.helpers import machine_of
from tests.integrations.serve_helpers import seed_config

ROOT = Path(__file__).resolve().parents[2]
GIB = startup.GIB


def test_flags_make_the_transfer_config(tmp_path: Path) -> None:
    config, notes = build_transfer_config(0.25, tmp_path / "kv", None)
    assert notes == []
    assert {k: config[k] for k in CONNECTOR} == CONNECTOR
    extra = config["kv_connector_extra_config"]
    assert extra == {"cpu_bytes_to_use": 2**28,
                     "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}]}
    assert (tmp_path / "kv").is_dir()


def test_config_file_whole_or_extra_only_and_flags_override(tmp_path: Path) -> None:
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({**CONNECTOR, "kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc"}}))
    assert build_transfer_config(None, None, whole)[0]["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc"}
    extra_only = tmp_path / "extra.json"
    extra_only.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 2}))
    config, _ = build_transfer_config(0.5, None, extra_only)
    assert config["kv_connector"] == "KVTierConnector"
    assert config["kv_connector_extra_config"] == {"cpu_bytes_to_use": 2**29, "blocks_per_chunk": 2}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--cpu-gb", "-1"], "--cpu-gb -1.0"),
        (["--cpu-gb", "1e9"], "--cpu-gb"),
        (["--fs", "/proc/kvtier-cannot-be-here"], "--fs /proc/kvtier-cannot-be-here"),
        (["--config", "/nonexistent/kvtier.json"], "--config /nonexistent/kvtier.json"),
    ],
)
def test_bad_flags_fail_fast_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "some-model", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_an_oversized_host_region_fails_the_region_check_before_vllm_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvtier serve` runs the host region's own size check (`check_region_size`) on the flags,
    after the memory plan: on a machine whose memory would hold it, /dev/shm still refuses."""
    assert main(["serve", "some-model", "--cpu-gb", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-gb = 1000000000.0 is invalid: the host tier over-commits" in err, err
    machine_of(monkeypatch, tmp_path, 1 << 62)
    assert main(["serve", "some-model", "--cpu-gb", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-gb = " in err and "the host region must fit in /dev/shm" in err, err


def test_bad_config_key_fails_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "eviction_polcy": "arc"}))
    assert main(["serve", "some-model", "--config", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert "eviction_polcy" in err and "eviction_policy" in err, err
    assert out == ""  # refused before any plan was made or vLLM started
    with pytest.raises(KVTierError, match="secondary_tiers"):
        build_transfer_config(None, None, _write(tmp_path, {"cpu_bytes_to_use": 1,
                                                           "secondary_tiers": [{"type": "nope"}]}))


def _write(tmp_path: Path, obj: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(obj))
    return path


def test_dry_run_prints_the_config_and_vllm_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "my-model", "--cpu-gb", "0.125", "--dry-run", "--", "--port", "9",
            "--kv-cache-memory-bytes", "1000000000", "--enforce-eager"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kvtier: memory plan: ")
    assert out[1].startswith("--kv-transfer-config '")
    assert json.loads(out[1].split("'", 1)[1].rstrip("'"))["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 2**27}
    assert "--model my-model --kv-transfer-config" in out[2]
    assert out[2].endswith("--port 9 --kv-cache-memory-bytes 1000000000 --enforce-eager")


def test_arguments_after_dashes_only_for_serve() -> None:
    with pytest.raises(SystemExit):
        main(["fsck", "/tmp", "--", "x"])


def _seed(tmp_path: Path, **top: Any) -> dict[str, Any]:
    return seed_config(tmp_path / "kv", **top)


@pytest.mark.parametrize("connector", [None, "OffloadingConnector", "KVTierConnector"])
def test_vllm_offloading_config_is_mapped_key_by_key(tmp_path: Path, connector: str | None) -> None:
    top = {} if connector is None else {"kv_connector": connector, "kv_role": "kv_both"}
    transfer, notes = build_transfer_config(None, None, _write(tmp_path, _seed(tmp_path, **top)),
                                            engine_block_size=128)
    assert {k: transfer[k] for k in CONNECTOR} == CONNECTOR
    assert transfer["kv_connector_extra_config"] == {
        "blocks_per_chunk": 2, "cpu_bytes_to_use": 1 << 26, "eviction_policy": "arc",
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"), "n_read_threads": 8}]}
    path = tmp_path / "config.json"
    head = f"kvtier: --config {path} (vLLM OffloadingConnector config -> KVTierConnector): "
    said = [line.removeprefix(head) for line in notes]
    assert said == [
        f"kv_connector {connector or '(none)'} " + ("kept" if connector == "KVTierConnector"
                                                     else "-> KVTierConnector"),
        "spec_name TieringOffloadingSpec -> KVTierConnector",
        "block_size 256 -> blocks_per_chunk 2 (engine blocks of 128 tokens)",
        "cpu_bytes_to_use kept", "eviction_policy kept",
        "secondary_tiers[0] fs -> fs (root_dir, n_read_threads kept)",
        "store_threshold ignored", "secondary_tiers[0].backpressure ignored"], notes


@pytest.mark.parametrize("given", [None, "fail"])
def test_a_failed_load_recomputes_unless_the_user_chose_otherwise(
    tmp_path: Path, given: str | None
) -> None:
    top = {} if given is None else {"kv_load_failure_policy": given}
    expected = given or "recompute"
    for raw in ({"kv_connector": "KVTierConnector", **top, "kv_connector_extra_config": {}},
                _seed(tmp_path, kv_connector="OffloadingConnector", **top)):
        transfer, _ = build_transfer_config(None, None, _write(tmp_path, raw), engine_block_size=128)
        assert transfer["kv_load_failure_policy"] == expected


def test_vllm_cpu_spec_ignores_tiers_and_kvtier_flags_still_apply(tmp_path: Path) -> None:
    raw = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 26, "blocks_per_chunk": 4,
        "secondary_tiers": [{"type": "obj"}]}}
    transfer, lines = build_transfer_config(0.0625, tmp_path / "fs", _write(tmp_path, raw))
    assert transfer["kv_connector_extra_config"] == {
        "blocks_per_chunk": 4, "cpu_bytes_to_use": 1 << 26,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}]}
    assert lines[-1].endswith(": secondary_tiers ignored")
    assert any(line.endswith(": blocks_per_chunk kept") for line in lines), lines


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1, "block_size": 200},
         "block_size = 200 is invalid: 200 tokens is not a multiple of the engine's block size, 128"),
        ({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1, "block_size": 0},
         "block_size = 0 is invalid: a positive number of tokens"),
        ({"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1, "block_size": 256,
          "blocks_per_chunk": 2}, "block_size = 256 is invalid: give block_size or blocks_per_chunk"),
        ({"spec_name": "LMCacheSpec", "cpu_bytes_to_use": 1}, "spec_name = 'LMCacheSpec'"),
        ({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1,
          "secondary_tiers": [{"type": "fs", "root_dir": "/tmp"}, {"type": "p2p"}]},
         "secondary_tiers[1].type = 'p2p' is invalid: only vLLM's fs tier maps"),
        ({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1,
          "eviction_policy": "lfu"}, "eviction_policy"),
    ],
)
def test_bad_vllm_config_fails_naming_the_key(
    tmp_path: Path, extra: dict[str, Any], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra})
    assert main(["serve", "m", "--config", str(path), "--dry-run", "--", "--kv-cache-memory-bytes", "1"]) == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_another_connector_in_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KVTierError, match="kv_connector = 'LMCacheConnectorV1'"):
        build_transfer_config(None, None, _write(tmp_path, {"kv_connector": "LMCacheConnectorV1"}))


def test_kv_offloading_size_is_cpu_gb(capsys: pytest.CaptureFixture[str]) -> None:
    dry = ["--dry-run", "--", "--kv-cache-memory-bytes", "1", "--enforce-eager"]
    assert main(["serve", "m", "--kv-offloading-size", "0.25", *dry]) == 0
    out = capsys.readouterr().out
    assert f'"cpu_bytes_to_use": {2**28}' in out
    assert main(["serve", "m", "--kv-offloading-size", "0", *dry]) == 2
    assert "--kv-offloading-size 0.0: must be a positive number" in capsys.readouterr().err
    assert main(["serve", "m", "--cpu-gb", "1", "--kv-offloading-size", "2", *dry]) == 2
    assert "--cpu-gb 1 and --kv-offloading-size 2: the same setting" in capsys.readouterr().err


def test_device_cache_size_from_total_memory_host_tier_weights_and_reserve() -> None:
    small = startup.device_cache_bytes(8 * GIB, GIB, GIB // 4, reserve=GIB)
    assert small.size == 8 * GIB - GIB - startup.PROCESS_MARGIN - GIB // 2 - GIB
    assert ("MemTotal 8.00 GiB - host tier 1.00 GiB - margin 2.50 GiB (server processes + 2 x "
            "0.25 GiB of weights) - reserve 1.00 GiB (os_reserve_bytes) = 3.50 GiB") in small.line()
    assert "capped" not in small.line()
    big = startup.device_cache_bytes(64 * GIB, GIB, 0)
    assert big.reserve == 64 * GIB // 10
    assert big.size == startup.DEVICE_CACHE_CAP and "capped at 4 GiB" in big.line()
    none_left = startup.device_cache_bytes(5 * GIB, 3 * GIB, 0)
    assert none_left.room < 0 and none_left.size == startup.MIN_DEVICE_CACHE


@pytest.mark.parametrize(
    ("user", "env", "added"),
    [
        ([], {}, ["--kv-cache-memory-bytes", str(4 << 30), "--enforce-eager"]),
        (["--kv-cache-memory-bytes", "1G"], {}, ["--enforce-eager"]),
        (["--gpu-memory-utilization=0.3", "--no-enforce-eager"], {}, []),
        (["--device-memory-utilization", "0.3", "-O3"], {}, []),
        (["--compilation-config", "{}"], {"VLLM_CPU_KVCACHE_SPACE": "2"}, []),
        (["--num-gpu-blocks-override", "64", "--enforce-eager"], {},
         ["--kv-cache-memory-bytes", str(4 << 30)]),
    ],
)
def test_startup_flags_added_only_where_the_user_gave_none(
    tmp_path: Path, user: list[str], env: dict[str, str], added: list[str]
) -> None:
    got, lines = startup.startup_args(user, host_bytes=1 << 30, model=str(tmp_path), cpu=True,
                                      env=env, total=32 * GIB)
    assert got == added
    assert len(lines) == len([a for a in added if a.startswith("--")]) + ("64" in user)
    assert startup.startup_args([], host_bytes=1, model="m", cpu=False, env={}, total=1) == ([], [])


def test_engine_block_size() -> None:
    assert startup.engine_block_size([], cpu=True) == 128
    assert startup.engine_block_size([], cpu=False) == 16
    assert startup.engine_block_size(["--block-size=32"], cpu=True) == 32
    with pytest.raises(KVTierError, match="--block-size x: must be a positive"):
        startup.engine_block_size(["--block-size", "x"], cpu=True)


def test_serve_sizes_from_total_memory_and_checks_the_plan(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The device cache is picked from MemTotal (free memory is never read: the fake machine has
    1 kB free), and the plan printed; a host tier that leaves less than the reserve is refused
    with the arithmetic."""
    monkeypatch.setattr(serve, "is_cpu_backend", lambda env: True)
    machine_of(monkeypatch, tmp_path, 10 * GIB)
    assert main(["serve", "m", "--cpu-gb", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("kvtier: device KV cache 4.00 GiB (--kv-cache-memory-bytes 4294967296)")
    assert out[1].startswith("kvtier: --enforce-eager")
    assert out[2] == ("kvtier: memory plan: MemTotal 10.00 GiB - vLLM's device KV cache 4.00 GiB - "
                      "weights and processes 2.00 GiB - host tier 1.00 GiB = 3.00 GiB left, the "
                      "reserve for the OS and page cache (os_reserve_bytes) 1.00 GiB")
    assert out[-1].endswith("--kv-cache-memory-bytes 4294967296 --enforce-eager")
    assert main(["serve", "m", "--cpu-gb", "6.5", "--dry-run"]) == 0
    assert "kvtier: device KV cache 0.50 GiB" in capsys.readouterr().out
    assert main(["serve", "m", "--cpu-gb", "7", "--dry-run"]) == 2
    assert ("--cpu-gb = 7.0 is invalid: the host tier over-commits this machine's memory: MemTotal "
            "10.00 GiB - vLLM's device KV cache 0.25 GiB - weights and processes 2.00 GiB - host "
            "tier 7.00 GiB = 0.75 GiB left, under the 1.00 GiB kept") in capsys.readouterr().err
    assert main(["serve", "m", "--cpu-gb", "7", "--os-reserve-gb", "0.5", "--dry-run"]) == 0
    assert '"os_reserve_bytes": 536870912' in capsys.readouterr().out
    assert main(["serve", "m", "--cpu-gb", "7", "--os-reserve-gb", "0", "--dry-run"]) == 0
    assert main(["serve", "m", "--cpu-gb", "7", "--os-reserve-gb", "-1", "--dry-run"]) == 2
    assert "--os-reserve-gb -1.0: must be a number of GiB >= 0" in capsys.readouterr().err
    assert main(["serve", "m", "--cpu-gb", "1", "--dry-run", "--", "--kv-cache-memory-bytes", "8G"]) == 2
    assert ("vLLM's device KV cache 8.00 GiB - weights and processes 2.00 GiB - host tier 1.00 GiB "
            "= -1.00 GiB left") in capsys.readouterr().err
