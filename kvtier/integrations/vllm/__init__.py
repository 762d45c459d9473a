"""kvtier's vLLM KV connector: `--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both", ...}'`."""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
