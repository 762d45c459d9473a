"""`kvtier serve` given the seeds' own vLLM configs and pilot line as written (`seed_configs`):
each key mapped or ignored on a line of its own, the CPU engine's block size named where the
seed's `block_size` is below it, `--kv-offloading-backend native` taken and `lmcache` refused,
the memory plan refusing what over-commits the machine (with its arithmetic) and passing what
fits (vLLM's size flags read as vLLM reads them, and named when unreadable), and
`--cpu-offload-gb` passed on with a warning that it offloads weights, not KV.

Every command is a dry run on a machine of a chosen size (`machine_of`); the /dev/shm check is
recorded, not run, where a seed's host tier is larger than this machine's /dev/shm may be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.integrations.vllm.serving import serve
from kvtier.integrations.vllm.serving.memory_plan import size_bytes
from tests.host.helpers import machine_of
from tests.integrations.seed_configs import MULTI_TIER, PILOT_OFFLOAD, PILOT_VLLM, TIERING

GIB = 1 << 30


@pytest.fixture
def shm_checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """The /dev/shm checks `kvtier serve` asked for, (size, key) each, none run."""
    checks: list[tuple[int, str]] = []
    monkeypatch.setattr(serve, "check_region_size",
                        lambda size, shm_dir, key: checks.append((size, key)) or size)
    return checks


def backend(monkeypatch: pytest.MonkeyPatch, cpu: bool) -> None:
    monkeypatch.setattr(serve, "is_cpu_backend", lambda env: cpu)


def seed_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "seed.json"
    path.write_text(text)
    return path


def dry_run(argv: list[str], vllm: list[str] | None = None) -> int:
    return main(["serve", "m", *argv, "--dry-run", *(["--", *vllm] if vllm else [])])


def transfer_of(out: str) -> dict[str, Any]:
    [line] = [x for x in out.splitlines() if x.startswith("--kv-transfer-config '")]
    found: dict[str, Any] = json.loads(line.split("'", 1)[1].rstrip("'"))
    return found


def test_first_seed_is_refused_on_a_small_machine_with_the_arithmetic(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    shm_checks: list[tuple[int, str]],
) -> None:
    backend(monkeypatch, cpu=True)
    machine_of(monkeypatch, tmp_path, 24 * GIB)
    assert dry_run(["--config", str(seed_file(tmp_path, TIERING))]) == 2
    assert ("cpu_bytes_to_use = 107374182400 is invalid: the host tier over-commits this machine's "
            "memory: MemTotal 24.00 GiB - vLLM's device KV cache 0.25 GiB - weights and processes "
            "2.00 GiB - host tier 100.00 GiB = -78.25 GiB left, under the 2.40 GiB kept for the OS"
            ) in capsys.readouterr().err
    assert shm_checks == []


def test_first_seed_maps_key_by_key_where_it_fits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    shm_checks: list[tuple[int, str]],
) -> None:
    backend(monkeypatch, cpu=True)
    machine_of(monkeypatch, tmp_path, 1024 * GIB)
    path = seed_file(tmp_path, TIERING)
    assert dry_run(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    head = f"kvtier: --config {path} (vLLM OffloadingConnector config -> KVTierConnector): "
    assert [line.removeprefix(head) for line in out.splitlines() if line.startswith(head)] == [
        "kv_connector (none) -> KVTierConnector", "spec_name TieringOffloadingSpec -> KVTierConnector",
        "cpu_bytes_to_use kept", "secondary_tiers[0] fs -> fs (root_dir kept)"]
    transfer = transfer_of(out)
    assert transfer["kv_connector"] == "KVTierConnector"
    assert transfer["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 107374182400,
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv-cache"}]}
    assert shm_checks == [(107374182400, "cpu_bytes_to_use")]


@pytest.mark.parametrize(("vllm", "engine_block"), [([], 128), (["--block-size", "32"], 32)])
def test_second_seeds_block_size_16_becomes_one_cpu_engine_block_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    shm_checks: list[tuple[int, str]], vllm: list[str], engine_block: int,
) -> None:
    backend(monkeypatch, cpu=True)
    machine_of(monkeypatch, tmp_path, 64 * GIB)
    assert dry_run(["--config", str(seed_file(tmp_path, MULTI_TIER))], vllm) == 0
    out = capsys.readouterr().out
    assert (f"block_size 16 -> blocks_per_chunk 1 (engine blocks of {engine_block} tokens)") in out
    assert (f"kvtier: warning: block_size 16 is below the engine's block of {engine_block} tokens: "
            f"a chunk is one engine block ({engine_block} tokens)") in out
    assert "secondary_tiers[0] fs -> fs (root_dir, n_read_threads, n_write_threads kept)" in out
    assert transfer_of(out)["kv_connector_extra_config"] == {
        "blocks_per_chunk": 1, "cpu_bytes_to_use": 10737418240, "eviction_policy": "lru",
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv_cache", "n_read_threads": 32,
                             "n_write_threads": 16}]}
    assert shm_checks == [(10737418240, "cpu_bytes_to_use")]


def test_the_pilot_line_over_commits_a_cpu_machine_and_fits_a_gpu_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    shm_checks: list[tuple[int, str]],
) -> None:
    """On vLLM's CPU backend --gpu-memory-utilization 0.85 gives 85% of MemTotal to the worker:
    with the pilot's 16 GiB host tier that leaves nothing for the OS. On a GPU the same line fits."""
    backend(monkeypatch, cpu=True)
    machine_of(monkeypatch, tmp_path, 64 * GIB)
    assert dry_run(PILOT_OFFLOAD, PILOT_VLLM) == 2
    assert ("--kv-offloading-size = 16.0 is invalid: the host tier over-commits this machine's "
            "memory: MemTotal 64.00 GiB - vLLM's CPU workers (0.85 x MemTotal each, "
            "--gpu-memory-utilization: weights and KV cache) 54.40 GiB - vLLM's processes 2.00 GiB "
            "- host tier 16.00 GiB = -8.40 GiB left, under the 6.40 GiB") in capsys.readouterr().err
    backend(monkeypatch, cpu=False)
    assert dry_run(PILOT_OFFLOAD, PILOT_VLLM) == 0
    out = capsys.readouterr().out
    assert ("kvtier: --kv-offloading-backend native: kvtier is the native KV offloading path of "
            "this server") in out
    assert ("kvtier: memory plan: MemTotal 64.00 GiB - vLLM's processes 2.00 GiB - host tier "
            "16.00 GiB = 46.00 GiB left") in out
    assert transfer_of(out)["kv_connector_extra_config"] == {"cpu_bytes_to_use": 16 * GIB}
    assert out.rstrip().endswith("--gpu-memory-utilization 0.85")
    assert shm_checks == [(16 * GIB, "--kv-offloading-size")]


@pytest.mark.parametrize(
    ("argv", "vllm", "said"),
    [
        (["--kv-offloading-backend", "lmcache"], [],
         "--kv-offloading-backend lmcache: kvtier serve serves kvtier, the native KV offloading "
         "path here, not LMCache"),
        (["--kv-offloading-backend", "mooncake"], [],
         "--kv-offloading-backend mooncake: vLLM's backends are native and lmcache"),
        ([], ["--kv-offloading-backend", "native"],
         "--kv-offloading-backend after --: kvtier serve reads it itself; use "
         "--kv-offloading-backend before --"),
        ([], ["--kv-offloading-size=16"], "--kv-offloading-size after --"),
        ([], ["--kv-transfer-config", "{}"], "--kv-transfer-config after --: kvtier serve reads it "
         "itself; use --config"),
    ],
)
def test_offloading_flags_kvtier_cannot_honour_are_refused(
    argv: list[str], vllm: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dry_run(argv, vllm) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("where", ["kvtier", "vllm"])
def test_cpu_offload_gb_is_passed_on_with_a_warning_and_counted_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    machine_of(monkeypatch, tmp_path, 64 * GIB)
    offload = ["--cpu-offload-gb", "4"]
    argv, vllm = (offload, ["-tp", "2"]) if where == "kvtier" else ([], [*offload, "-tp", "2"])
    for cpu in (False, True):
        backend(monkeypatch, cpu)
        assert dry_run(["--cpu-gb", "1", *argv], [*vllm, "--kv-cache-memory-bytes", "1G"]) == 0
        out = capsys.readouterr().out
        assert ("kvtier: warning: --cpu-offload-gb 4 offloads model weights to CPU memory (vLLM's "
                "weight offload), not the KV cache: it adds no KV capacity") in out
        assert out.count("--cpu-offload-gb 4") == 2  # the warning, and vLLM's command
        counted = "weights offloaded by --cpu-offload-gb 8.00 GiB"  # 4 GiB per device, TP=2
        assert (counted in out) == (not cpu), out


@pytest.mark.parametrize(
    ("vllm", "said"),
    [
        (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes lots: must be a number of bytes"),
        (["--cpu-offload-gb", "inf"], "--cpu-offload-gb inf: must be GiB >= 0"),
        (["-tp", "1.5"], "--tensor-parallel-size 1.5: must be a positive whole number"),
    ],
)
def test_vllm_flags_the_plan_cannot_read_are_named(
    monkeypatch: pytest.MonkeyPatch, vllm: list[str], said: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend(monkeypatch, cpu="--cpu-offload-gb" not in vllm)
    assert dry_run(["--cpu-gb", "1"], vllm) == 2
    assert said in capsys.readouterr().err


def test_vllm_size_suffixes_are_read_as_vllm_reads_them() -> None:
    assert [size_bytes("f", t) for t in ("4096", "1k", "1K", "1.5g", "2G", "1T")] == [
        4096, 1000, 1024, 1_500_000_000, 2 * GIB, 1 << 40]
