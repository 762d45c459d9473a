"""`kvtier serve`: the kv-transfer-config built from its flags, bad flags refused before vLLM starts,
and (slow) a real vLLM OpenAI server on a loopback port that answers a chat and exposes kvtier_
metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.multiturn.server import stop_process_group
from kvtier.cli import main
from kvtier.errors import KVTierError
from kvtier.integrations.vllm.launch import CONNECTOR, isolated_env
from kvtier.integrations.vllm.serve import build_transfer_config

ROOT = Path(__file__).resolve().parents[1]


def test_flags_make_the_transfer_config(tmp_path: Path) -> None:
    config = build_transfer_config(0.25, tmp_path / "kv", None)
    assert {k: config[k] for k in CONNECTOR} == CONNECTOR
    extra = config["kv_connector_extra_config"]
    assert extra == {"cpu_bytes_to_use": 2**28,
                     "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")}]}
    assert (tmp_path / "kv").is_dir()


def test_config_file_whole_or_extra_only_and_flags_override(tmp_path: Path) -> None:
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({**CONNECTOR, "kv_connector_extra_config": {
        "cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc"}}))
    assert build_transfer_config(None, None, whole)["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc"}
    extra_only = tmp_path / "extra.json"
    extra_only.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 2}))
    config = build_transfer_config(0.5, None, extra_only)
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


def test_bad_config_key_fails_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "eviction_polcy": "arc"}))
    started = time.monotonic()
    assert main(["serve", "some-model", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "eviction_polcy" in err and "eviction_policy" in err, err
    assert time.monotonic() - started < 5
    with pytest.raises(KVTierError, match="secondary_tiers"):
        build_transfer_config(None, None, _write(tmp_path, {"cpu_bytes_to_use": 1,
                                                           "secondary_tiers": [{"type": "nope"}]}))


def _write(tmp_path: Path, obj: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(obj))
    return path


def test_dry_run_prints_the_config_and_vllm_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "my-model", "--cpu-gb", "0.125", "--dry-run", "--", "--port", "9"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("--kv-transfer-config '")
    assert json.loads(out[0].split("'", 1)[1].rstrip("'"))["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 2**27}
    assert "--model my-model --kv-transfer-config" in out[1] and out[1].endswith("--port 9")


def test_arguments_after_dashes_only_for_serve() -> None:
    with pytest.raises(SystemExit):
        main(["fsck", "/tmp", "--", "x"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return str(resp.read().decode())


@pytest.mark.slow
def test_real_server_answers_a_chat_with_kvtier_metrics(tmp_path: Path) -> None:
    from kvtier.tools.models import prepare_smollm2

    model = prepare_smollm2(quiet=True)
    port = _free_port()
    env = {**os.environ, **isolated_env(tmp_path, in_process=False)}
    vllm_args = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smol",
                 "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
                 "--block-size", "32", "--num-gpu-blocks-override", "64",
                 "--kv-cache-memory-bytes", str(100 << 20), "--max-num-seqs", "2"]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", str(model), "--cpu-gb", "0.0625",
         "--fs", str(tmp_path / "fs"), "--", *vllm_args],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server not up in 150 s"
            try:
                _get(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        reply = json.loads(_get(f"{base}/v1/chat/completions", {
            "model": "smol", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}))
        assert "Paris" in reply["choices"][0]["message"]["content"]
        assert reply["usage"]["prompt_tokens"] > 0
        metrics = _get(f"{base}/metrics")
        assert "kvtier_" in metrics
        assert "--kv-transfer-config '" in (tmp_path / "server.log").read_text()
    finally:
        stop_process_group(proc, 20.0)
        log.close()


