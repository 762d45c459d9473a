"""A model whose KV cache groups kvtier cannot hold yet (a Mamba2 hybrid: GraniteMoeHybrid, one
Mamba2 layer and one attention layer, tiny random weights) stops vLLM at startup with kvtier's
message naming the spec and its layers, not a crash while serving. vLLM keeps its hybrid manager on
for kvtier (`SupportsHMA`), so the model gets as far as kvtier's check. Runs in a child process: an
engine that fails half-built leaves vLLM's per-process connector behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.conftest import run_child

pytestmark = pytest.mark.slow


def test_a_mamba2_hybrid_is_refused_at_startup_naming_what_is_missing(vllm_env: Path) -> None:
    from kvtier.tools.tiny_models import build_tiny_model

    model = str(build_tiny_model("granite-hybrid"))
    llm = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256}
    (run,) = run_child(
        {"model": model, "extra_configs": [{"cpu_bytes_to_use": 1 << 24}], "llm": llm, "prompts": []}
    )
    error = run.get("error", "")
    assert "MambaSpec" in error and "not supported yet" in error, error
    assert "model.layers.0" in error, error
