"""Config parsing: defaults, every validation error names its key, plugins resolve."""

from __future__ import annotations

import pytest

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError


def parse(**raw):
    return KVTierConfig.from_dict({"cpu_bytes_to_use": 1 << 20, **raw})


def test_defaults() -> None:
    cfg = parse()
    assert cfg.cpu_bytes_to_use == 1 << 20
    assert cfg.blocks_per_chunk == 1 and cfg.eviction_policy == "lru"
    assert cfg.secondary_tiers == () and cfg.load_policy == "always"


def test_full_config_is_parsed() -> None:
    cfg = parse(
        blocks_per_chunk=2, eviction_policy="arc", cpu_bytes_to_use=1e9,
        secondary_tiers=[{"type": "fs", "root_dir": "/tmp/x", "max_bytes": 1e11},
                         {"type": "memory", "name": "mem2"}],
    )
    assert cfg.cpu_bytes_to_use == 1_000_000_000 and cfg.blocks_per_chunk == 2
    fs, mem = cfg.secondary_tiers
    assert (fs.type, fs.name, fs.options) == ("fs", "fs", {"root_dir": "/tmp/x", "max_bytes": 1e11})
    assert (mem.type, mem.name, mem.options) == ("memory", "mem2", {})


def test_os_reserve_defaults_to_the_plans_own_and_takes_bytes() -> None:
    """None lets the memory plan keep a tenth of MemTotal; a number is the reserve in bytes."""
    assert parse().os_reserve_bytes is None
    assert parse(os_reserve_bytes=0).os_reserve_bytes == 0
    assert parse(os_reserve_bytes=4e9).os_reserve_bytes == 4_000_000_000


def test_missing_cpu_bytes_is_named() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use") as e:
        KVTierConfig.from_dict({})
    assert e.value.key == "cpu_bytes_to_use"


@pytest.mark.parametrize(
    ("raw", "key", "hint"),
    [
        ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use", ">= 1"),
        ({"cpu_bytes_to_use": "1G"}, "cpu_bytes_to_use", "integer"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk", ">= 1"),
        ({"blocks_per_chunk": 1.5}, "blocks_per_chunk", "integer"),
        ({"blocks_per_chunks": 2}, "blocks_per_chunks", "did you mean 'blocks_per_chunk'"),
        ({"chunk_tokens": 0}, "chunk_tokens", ">= 1"),
        ({"chunk_tokens": 256, "blocks_per_chunk": 2}, "chunk_tokens", "not both"),
        ({"stream_promotions": "yes"}, "stream_promotions", "true or false"),
        ({"eviction_policy": "lfu2"}, "eviction_policy", "known: arc, lru"),
        ({"eviction_policy": "lru", "eviction_policy_module_path": "no.such.mod"},
         "eviction_policy", "cannot import"),
        ({"hash_algorithm": "md5"}, "hash_algorithm", "sha256"),
        ({"load_policy": "sometimes"}, "load_policy", "one of always, auto"),
        ({"secondary_tiers": {"type": "fs"}}, "secondary_tiers", "list"),
        ({"secondary_tiers": [{"root_dir": "/x"}]}, "secondary_tiers[0].type", "required"),
        ({"secondary_tiers": [{"type": "fss"}]}, "secondary_tiers[0].type", "did you mean 'fs'"),
        ({"secondary_tiers": [{"type": "fs", "root_dir": "/x", "max_byte": 1}]},
         "secondary_tiers[0].max_byte", "did you mean 'max_bytes'"),
        ({"secondary_tiers": [{"type": "memory"}, {"type": "fs", "root_dir": "/x", "max_bytes": -1}]},
         "secondary_tiers[1].max_bytes", "positive"),
        ({"secondary_tiers": [{"type": "redis", "url": "http://h:1"}]},
         "secondary_tiers[0].url", "redis://"),
        ({"secondary_tiers": [{"type": "memory"}, {"type": "memory"}]},
         "secondary_tiers[1].name", "unique"),
        ({"secondary_tiers": [{"type": "NotATier", "module_path": "tests.tiers.plugin_tier"}]},
         "secondary_tiers[0].type", "deriving from SecondaryTier"),
        ({"tier_job_timeout_s": -1}, "tier_job_timeout_s", "positive"),
        ({"os_reserve_bytes": -1}, "os_reserve_bytes", ">= 0"),
        ({"os_reserve_bytes": "2G"}, "os_reserve_bytes", "integer"),
    ],
)
def test_bad_values_name_the_key(raw, key, hint) -> None:
    with pytest.raises(ConfigError) as e:
        parse(**raw)
    assert e.value.key == key
    assert hint in str(e.value)
    assert key in str(e.value)


def test_external_tier_and_policy_by_module_path() -> None:
    cfg = parse(
        eviction_policy="LRUPolicy", eviction_policy_module_path="kvtier.policies.lru",
        secondary_tiers=[{"type": "DelayedMemoryTier", "module_path": "tests.tiers.plugin_tier",
                          "delay_s": 0.1}],
    )
    assert cfg.secondary_tiers[0].module_path == "tests.tiers.plugin_tier"
