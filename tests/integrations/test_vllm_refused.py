"""Configurations kvtier refuses stop vLLM at startup with kvtier's message, naming what is wrong,
not a crash while serving, and leave nothing behind (`refused_start`: each engine starts in this
process, no other engine being up; what a half-built engine leaves in vLLM's per-process state is
taken down after it, and no host region of kvtier's is left in /dev/shm).

- bad kvtier configs on the test model: a missing host size, an unknown tier type, an fs root that
  cannot be written, a host tier that over-commits the machine's memory;
- a model whose recurrent states kvtier cannot store (a Mamba2 hybrid: GraniteMoeHybrid, one Mamba2
  layer and one attention layer, tiny random weights, with prefix caching off, so vLLM keeps no
  state at block boundaries: `mamba_cache_mode` "none"). vLLM keeps its hybrid manager on for
  kvtier (`SupportsHMA`), so the model gets as far as kvtier's check. (Mamba1 groups, the other
  state kind kvtier refuses, cannot be built on the CPU backend: see
  tests/integrations/test_groups.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integrations.conftest import refused_start
from tests.integrations.test_vllm_tiers import LLM_ARGS

pytestmark = pytest.mark.slow


def test_bad_configs_stop_vllm_with_kvtiers_message(vllm_env: Path) -> None:
    unwritable = vllm_env / "a-file"  # a path under a file: unwritable even for root
    unwritable.write_text("")
    shm_free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    configs = [
        {"blocks_per_chunk": 1},
        {"cpu_bytes_to_use": 1 << 26, "secondary_tiers": [{"type": "tape"}]},
        {"cpu_bytes_to_use": 1 << 26,
         "secondary_tiers": [{"type": "fs", "root_dir": str(unwritable / "kv")}]},
        {"cpu_bytes_to_use": shm_free + (1 << 30)},
    ]
    errors = [refused_start(config, **LLM_ARGS) for config in configs]
    assert "cpu_bytes_to_use" in errors[0], errors[0]
    assert "tape" in errors[1] and "fs" in errors[1], errors[1]
    assert "root_dir" in errors[2], errors[2]
    # the memory plan (MemTotal less the engine's needs and the OS reserve) refuses it, or, where
    # /dev/shm is smaller than that plan allows, the region check does: both name the key
    assert "cpu_bytes_to_use" in errors[3], errors[3]
    assert "/dev/shm" in errors[3] or "os_reserve_bytes" in errors[3], errors[3]


def test_a_mamba2_hybrid_without_prefix_caching_is_refused_at_startup_naming_what_is_missing(
    vllm_env: Path,
) -> None:
    from kvtier.tools.tiny_models import build_tiny_model

    llm = {
        "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256,
        "enable_prefix_caching": False,
    }
    error = refused_start({"cpu_bytes_to_use": 1 << 24}, build_tiny_model("granite-hybrid"), **llm)
    assert "mamba_cache_mode" in error and "enable_prefix_caching" in error, error
