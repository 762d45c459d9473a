"""kvtier's vLLM KV connector: `--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both", ...}'`.

`KVTierConnector` is imported on first access, so the modules of this package that do not need
vLLM itself (its KV layouts, `serve`) import on a machine without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
