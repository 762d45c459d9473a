"""The named configurations a sweep compares, each building the engine's device cache and kvtier's
extra config (`kv_connector_extra_config`, None for vLLM alone).

- `no-offload`: vLLM's own device prefix cache only.
- `host`: kvtier with a host tier of `host_chunks` one-block chunks (LRU).
- `host+fs`: the same plus an fs tier in a fresh directory.
- `all-fits`: vLLM alone with a device cache that holds the whole workload (the upper bound).
- `obj`, `redis`: host tier plus an obj (S3) / redis tier; need `--obj-endpoint` and
  `--obj-bucket` (credentials from the AWS environment) / `--redis-url`.
- `admission`: host + fs with the admission policy named by `--admission-policy`.

`CONFIGS` maps each name to its builder; `resolve` raises ValueError listing the known names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig


@dataclass(frozen=True)
class BenchContext:
    """What the builders need: sizes in engine blocks and chunks, and where files go."""

    block_bytes: int
    device_blocks: int
    all_fits_blocks: int
    host_chunks: int
    work_dir: Path
    options: Mapping[str, str] = field(default_factory=dict)

    def option(self, key: str, config: str) -> str:
        value = self.options.get(key)
        if not value:
            raise ValueError(f"configuration {config!r} needs --{key.replace('_', '-')}")
        return value


@dataclass(frozen=True)
class EngineConfig:
    """One configuration, ready to start: device blocks and kvtier's config (or None)."""

    name: str
    device_blocks: int
    kvtier: dict[str, Any] | None


def _host(ctx: BenchContext) -> dict[str, Any]:
    return {"cpu_bytes_to_use": ctx.host_chunks * ctx.block_bytes, "eviction_policy": "lru"}


def _fs_dir(ctx: BenchContext, name: str) -> Path:
    path = ctx.work_dir / f"fs-{name.replace('+', '-')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _no_offload(ctx: BenchContext) -> EngineConfig:
    return EngineConfig("no-offload", ctx.device_blocks, None)


def _all_fits(ctx: BenchContext) -> EngineConfig:
    return EngineConfig("all-fits", ctx.all_fits_blocks, None)


def _host_only(ctx: BenchContext) -> EngineConfig:
    return EngineConfig("host", ctx.device_blocks, _host(ctx))


def _host_fs(ctx: BenchContext) -> EngineConfig:
    tiers = [{"type": "fs", "root_dir": str(_fs_dir(ctx, "host+fs"))}]
    return EngineConfig("host+fs", ctx.device_blocks, {**_host(ctx), "secondary_tiers": tiers})


def _obj(ctx: BenchContext) -> EngineConfig:
    tier = {"type": "obj", "endpoint": ctx.option("obj_endpoint", "obj"),
            "bucket": ctx.option("obj_bucket", "obj"), "prefix": f"kvtier-bench-{ctx.work_dir.name}"}
    return EngineConfig("obj", ctx.device_blocks, {**_host(ctx), "secondary_tiers": [tier]})


def _redis(ctx: BenchContext) -> EngineConfig:
    tier = {"type": "redis", "url": ctx.option("redis_url", "redis"),
            "key_prefix": f"kvtier-bench-{ctx.work_dir.name}"}
    return EngineConfig("redis", ctx.device_blocks, {**_host(ctx), "secondary_tiers": [tier]})


def _admission(ctx: BenchContext) -> EngineConfig:
    tiers = [{"type": "fs", "root_dir": str(_fs_dir(ctx, "admission"))}]
    raw = {**_host(ctx), "admission_policy": ctx.option("admission_policy", "admission"),
           "secondary_tiers": tiers}
    return EngineConfig("admission", ctx.device_blocks, raw)


CONFIGS: dict[str, Callable[[BenchContext], EngineConfig]] = {
    "no-offload": _no_offload,
    "host": _host_only,
    "host+fs": _host_fs,
    "all-fits": _all_fits,
    "obj": _obj,
    "redis": _redis,
    "admission": _admission,
}


def check_names(names: list[str]) -> None:
    """ValueError naming an unknown configuration and listing the known ones."""
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"--configs: unknown configuration {name!r} "
                             f"(known: {', '.join(CONFIGS)})")


def resolve(name: str, ctx: BenchContext) -> EngineConfig:
    """Build configuration `name`; kvtier's part is validated (`KVTierConfig.from_dict`)."""
    check_names([name])
    config = CONFIGS[name](ctx)
    if config.kvtier is not None:
        KVTierConfig.from_dict(config.kvtier)
    return config
