"""A kv-transfer-config written for vLLM's OffloadingConnector, mapped to the KVTierConnector.

A vLLM user switches to kvtier by changing the connector name only, or not at all: the one mapping
here serves `kvtier serve --config FILE` (a whole config or its extra config alone) and the
connector itself, loaded by vLLM with such an extra config (`kv_connector_extra_config` given to
KVTierConnector as it was written for OffloadingConnector). A config is recognised (`is_native`) by
`"kv_connector": "OffloadingConnector"`, or by a key of `kv_connector_extra_config` that only vLLM's
offloading specs read (`NATIVE_ONLY`, `spec_name` among them; the configuration of the article on
vLLM's tiered offloading that README names gives no connector name at all). `to_kvtier` maps it key
by key and records each key as mapped, kept or ignored, one line each (`NativeMapping.lines`):

- `spec_name` (TieringOffloadingSpec or CPUOffloadingSpec; absent: CPUOffloadingSpec, as in vLLM)
  becomes the KVTierConnector; `spec_module_path` is ignored;
- `block_size` (the offload unit in tokens) becomes `blocks_per_chunk` = block_size / the engine's
  block size (vLLM's `--block-size`, by default 128 on CPU and 16 on CUDA). A block_size below the
  engine's block (the 16 of README's operator's guide, on the CPU backend, whose blocks are 32 tokens
  or more) becomes one engine block per chunk, with a warning naming both sizes; one above it that
  is not a multiple is refused with both numbers;
- `cpu_bytes_to_use`, `eviction_policy` and `blocks_per_chunk` (vLLM's and kvtier's alike) and
  every other key kvtier reads (`KVTierConfig.field_names`, `secondary_tiers` aside) keep their
  names and meaning;
- `secondary_tiers` (read by TieringOffloadingSpec only, as in vLLM): each vLLM fs tier becomes
  kvtier's fs tier (`root_dir`, `n_read_threads`, `n_write_threads`; vLLM's `enable_kv_events`,
  `locality`, `backpressure`, `module_path` ignored); another tier type is refused;
- every other key (`store_threshold`, `offload_prompt_only`, `cache_policy_module_path`, ...) is
  ignored: kvtier has no such setting.

kvtier's own config validation (`KVTierConfig.from_dict`) then checks the result as for any config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.serving.launch import CONNECTOR

NATIVE_CONNECTOR = "OffloadingConnector"
SPECS = ("TieringOffloadingSpec", "CPUOffloadingSpec")
KEPT = tuple(key for key in KVTierConfig.field_names() if key != "secondary_tiers")
"""Keys kept as they are: those vLLM's specs and kvtier share with the same meaning
(`cpu_bytes_to_use`, `eviction_policy`, `blocks_per_chunk`) and kvtier's own."""
NATIVE_ONLY = frozenset({
    "spec_name", "spec_module_path", "block_size", "cache_policy_module_path", "store_threshold",
    "max_tracker_size", "offload_prompt_only", "self_describing_kv_events", "canonical_layout",
    "backpressure", "enable_telemetry",
})
"""Keys of `kv_connector_extra_config` that vLLM's offloading specs read and kvtier does not."""
FS_IGNORED = ("enable_kv_events", "locality", "backpressure", "module_path")
"""Keys of a vLLM fs tier entry kvtier has no use for; its other keys (`root_dir`, the thread
counts) are kvtier's fs options too, and kvtier checks them."""


def is_native(raw: Mapping[str, Any]) -> bool:
    """Whether the kv-transfer-config `raw` (a whole one, or its extra config alone) was written for
    vLLM's OffloadingConnector (see the module doc)."""
    if raw.get("kv_connector") == NATIVE_CONNECTOR:
        return True
    extra = raw.get("kv_connector_extra_config", raw)
    return isinstance(extra, Mapping) and any(key in NATIVE_ONLY for key in extra)


@dataclass
class NativeMapping:
    """The kv-transfer-config for kvtier, what became of each key of vLLM's, and the warnings."""

    transfer: dict[str, Any]
    mapped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def extra(self) -> dict[str, Any]:
        """kvtier's `kv_connector_extra_config`."""
        extra: dict[str, Any] = self.transfer["kv_connector_extra_config"]
        return extra

    def lines(self, source: str) -> list[str]:
        """One line per key mapped (or kept) and per key ignored, each naming `source`."""
        head = f"kvtier: {source} (vLLM OffloadingConnector config -> KVTierConnector):"
        return ([f"{head} {what}" for what in self.mapped]
                + [f"{head} {key} ignored" for key in self.ignored])


def to_kvtier(raw: Mapping[str, Any], engine_block_size: int) -> NativeMapping:
    """`raw` (recognised by `is_native`: a whole kv-transfer-config, or its extra config alone) as
    a KVTierConnector kv-transfer-config, for an engine of `engine_block_size` tokens per block.

    Raises `ConfigError` naming the key (dotted for a tier) for a value kvtier cannot map."""
    whole = "kv_connector_extra_config" in raw or "kv_connector" in raw
    extra = raw.get("kv_connector_extra_config", {}) if whole else raw
    if not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", extra, "must be a JSON object")
    top = {k: v for k, v in raw.items() if k != "kv_connector_extra_config"} if whole else {}
    kept: dict[str, Any] = {k: top[k] for k in ("kv_role", "kv_load_failure_policy") if k in top}
    out = NativeMapping({**top, **CONNECTOR, **kept})
    if whole:
        name = top.get("kv_connector", "(none)")
        out.mapped.append(f"kv_connector {name} kept" if name == CONNECTOR["kv_connector"]
                          else f"kv_connector {name} -> {CONNECTOR['kv_connector']}")
    if top.get("kv_connector_module_path") not in (None, CONNECTOR["kv_connector_module_path"]):
        out.ignored.append("kv_connector_module_path")
    out.transfer["kv_connector_extra_config"] = _extra(extra, engine_block_size, out)
    return out


def _extra(extra: Mapping[str, Any], engine_block_size: int, out: NativeMapping) -> dict[str, Any]:
    spec = extra.get("spec_name", "CPUOffloadingSpec")
    if spec not in SPECS:
        raise ConfigError("spec_name", spec, f"one of {', '.join(SPECS)} (vLLM's specs kvtier replaces)")
    out.mapped.append(f"spec_name {spec} -> KVTierConnector")
    mapped: dict[str, Any] = {}
    if "block_size" in extra:
        if "blocks_per_chunk" in extra:
            raise ConfigError("block_size", extra["block_size"],
                              "give block_size or blocks_per_chunk, not both (as vLLM requires)")
        mapped["blocks_per_chunk"] = _blocks_per_chunk(extra["block_size"], engine_block_size, out)
        out.mapped.append(f"block_size {extra['block_size']} -> blocks_per_chunk "
                          f"{mapped['blocks_per_chunk']} (engine blocks of {engine_block_size} tokens)")
    for key in KEPT:
        if key in extra:
            mapped[key] = extra[key]
            out.mapped.append(f"{key} kept")
    tiering = spec == "TieringOffloadingSpec" and "secondary_tiers" in extra
    handled = {"spec_name", "block_size", *KEPT, *(["secondary_tiers"] if tiering else [])}
    out.ignored += [key for key in extra if key not in handled]
    if tiering:
        mapped["secondary_tiers"] = _tiers(extra["secondary_tiers"], out)
    return mapped


def _blocks_per_chunk(block_size: Any, engine_block_size: int, out: NativeMapping) -> int:
    """Engine blocks per chunk for vLLM's `block_size`: one when it is below the engine's block
    (with a warning in `out`), else the quotient; ConfigError for a size that is not a multiple."""
    engine = (f"the engine's block size, {engine_block_size} tokens (vLLM's --block-size; by "
              "default 128 on CPU, 16 on CUDA)")
    if isinstance(block_size, float) and block_size.is_integer():
        block_size = int(block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("block_size", block_size,
                          f"a positive number of tokens: below or a multiple of {engine}")
    if block_size < engine_block_size:
        out.warnings.append(
            f"kvtier: warning: block_size {block_size} is below the engine's block of "
            f"{engine_block_size} tokens: a chunk is one engine block ({engine_block_size} tokens), "
            "the smallest unit kvtier moves")
        return 1
    if block_size % engine_block_size:
        raise ConfigError("block_size", block_size,
                          f"{block_size} tokens is not a multiple of {engine}")
    return block_size // engine_block_size


def _tiers(tiers: Any, out: NativeMapping) -> list[dict[str, Any]]:
    if not isinstance(tiers, list):
        raise ConfigError("secondary_tiers", tiers, "must be a JSON list of tier objects")
    mapped: list[dict[str, Any]] = []
    for i, tier in enumerate(tiers):
        key = f"secondary_tiers[{i}]"
        if not isinstance(tier, Mapping):
            raise ConfigError(key, tier, "must be a JSON object with a 'type'")
        if tier.get("type") != "fs":
            raise ConfigError(f"{key}.type", tier.get("type"),
                              "only vLLM's fs tier maps to kvtier; for obj, p2p or another tier "
                              "write kvtier's own config (kv_connector KVTierConnector, README)")
        kept = [k for k in tier if k not in FS_IGNORED and k != "type"]
        mapped.append({k: v for k, v in tier.items() if k not in FS_IGNORED})
        out.mapped.append(f"{key} fs -> fs ({', '.join(kept) or 'no options'} kept)")
        out.ignored += [f"{key}.{k}" for k in tier if k in FS_IGNORED]
    return mapped
