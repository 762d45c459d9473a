"""A model whose recurrent states kvtier cannot store (a Mamba2 hybrid: GraniteMoeHybrid, one
Mamba2 layer and one attention layer, tiny random weights, with prefix caching off, so vLLM keeps no
state at block boundaries: `mamba_cache_mode` "none") stops vLLM at startup with kvtier's message
naming the setting, not a crash while serving. vLLM keeps its hybrid manager on for kvtier
(`SupportsHMA`), so the model gets as far as kvtier's check. (Mamba1 groups, the other state kind
kvtier refuses, cannot be built on the CPU backend: see tests/integrations/test_groups.py.) Runs in a
child process: an engine that fails half-built leaves vLLM's per-process connector behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.conftest import run_child

pytestmark = pytest.mark.slow


def test_a_mamba2_hybrid_without_prefix_caching_is_refused_at_startup_naming_what_is_missing(
    vllm_env: Path,
) -> None:
    from kvtier.tools.tiny_models import build_tiny_model

    model = str(build_tiny_model("granite-hybrid"))
    llm = {
        "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256,
        "enable_prefix_caching": False,
    }
    (run,) = run_child(
        {"model": model, "extra_configs": [{"cpu_bytes_to_use": 1 << 24}], "llm": llm, "prompts": []}
    )
    error = run.get("error", "")
    assert "mamba_cache_mode" in error and "enable_prefix_caching" in error, error
