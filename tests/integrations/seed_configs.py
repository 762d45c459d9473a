"""vLLM's own offloading configs as the two seed articles give them, character for character.

`TIERING` is the first seed's `--kv-transfer-config` (vLLM's tiering with an fs tier, no connector
name, a 100 GiB host tier); `MULTI_TIER` is the second seed's "faithful copy of the documented
multi-tier example" (OffloadingConnector, `block_size` 16, a 10 GiB host tier, an fs tier with
thread counts); `PILOT_VLLM` and `PILOT_OFFLOAD` are the second seed's bounded CPU pilot, flag for
flag. Tests that must fit this machine say which value they change and why.
"""

from __future__ import annotations

import json
from typing import Any

TIERING = '''{"kv_connector_extra_config": {
    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 107374182400,
    "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv-cache"}]}}'''

MULTI_TIER = '''{
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
      "spec_name": "TieringOffloadingSpec",
      "cpu_bytes_to_use": 10737418240,
      "block_size": 16,
      "eviction_policy": "lru",
      "secondary_tiers": [
        {
          "type": "fs",
          "root_dir": "/mnt/kv_cache",
          "n_read_threads": 32,
          "n_write_threads": 16
        }
      ]
    }
  }'''

PILOT_VLLM = ["--gpu-memory-utilization", "0.85"]
"""The pilot line's flag that only vLLM reads (given to `kvtier serve` after `--`)."""
PILOT_OFFLOAD = ["--kv-offloading-size", "16", "--kv-offloading-backend", "native"]
"""The pilot line's offloading flags, which `kvtier serve` reads as vLLM does."""


def extra(text: str) -> dict[str, Any]:
    """The `kv_connector_extra_config` of a seed's config."""
    found: dict[str, Any] = json.loads(text)["kv_connector_extra_config"]
    return found
