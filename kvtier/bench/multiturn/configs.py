"""The named configurations a sweep compares, each building the engine's device cache and its
connector: kvtier's extra config (`kv_connector_extra_config`), a baseline connector's whole
kv-transfer-config (vLLM's own tiering, LMCache), or neither (vLLM alone).

- `no-offload`: vLLM's own device prefix cache only.
- `host`: kvtier with a host tier of `host_chunks` one-block chunks (LRU).
- `host+fs`: the same plus an fs tier in a fresh directory.
- `vllm-native`: vLLM's own tiering (OffloadingConnector, `TieringOffloadingSpec`) with a CPU tier of
  the same bytes as `host` (LRU), run on the CPU backend by our shim
  `benchmarks/baselines/vllm_native.py` (`NATIVE_SPEC`).
- `vllm-native+fs`: the same plus vLLM's fs tier in a fresh directory (the sizes of `host+fs`).
- `lmcache`: LMCache (vLLM's LMCacheConnectorV1, with our copy half for the CPU backend,
  `benchmarks/baselines/lmcache_cpu.py`) with its local CPU backend of the same bytes as `host`
  (LRU) and LMCache chunks of one engine block (`chunk_size` = the engine's block size, so each
  system stores and hits at the same granularity). Needs LMCache: `scripts/install_lmcache.sh`.
- `lmcache+disk`: the same plus LMCache's local disk backend in a fresh directory, of the bytes
  of `host+fs`'s fs tier (the whole workload).
- `all-fits`: vLLM alone with a device cache that holds the whole workload (the upper bound).
- `obj`, `redis`: host tier plus an obj (S3) / redis tier; need `--obj-endpoint` and
  `--obj-bucket` (credentials from the AWS environment) / `--redis-url`.
- `admission`: host + fs with the admission policy named by `--admission-policy`.
- `host+fs-frequency`, `host+fs-priority`: host + fs with that admission policy at both gates
  (`host+fs` is the same with `all`), so `--configs host+fs,host+fs-frequency` compares them.
- `host+fs-wait`: host + fs with `promotion_wait_s` 0.05 (a request whose prefix comes from fs
  loads in the step of its lookup).

The baseline connectors are modules of `benchmarks/baselines/`, imported by the engine from
`baselines_root()` (on its `sys.path`, or a server's `PYTHONPATH`).

With `--blocks-per-chunk N` (option `blocks_per_chunk`) every kvtier configuration offloads in
chunks of N engine blocks (the host tier keeps its bytes); the others are unchanged. `--chunk-tokens
T` (option `chunk_tokens`) sets the same in tokens.

With `--load-policy P` (option `load_policy`) every kvtier configuration loads or recomputes by
`load_policy` P (`kvtier.engine.load_choice`); the others are unchanged.

With `--trace DIR` (option `trace_dir`) every kvtier configuration writes its run's connector trace
to `DIR/<run directory>.jsonl`.

By default every configuration offloads in chunks of one engine block, the same block size and the
same host bytes, so kvtier and each baseline differ only in the connector.

`CONFIGS` maps each name to its builder; `resolve` raises ValueError listing the known names.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig

GIB = 1 << 30

NATIVE_CONNECTOR: dict[str, str] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
"""The keys of a kv-transfer-config that load vLLM's own OffloadingConnector, in both roles."""

NATIVE_SPEC: dict[str, str] = {"spec_name": "HostTieringSpec",
                               "spec_module_path": "benchmarks.baselines.vllm_native"}
"""The extra-config keys that make vLLM's spec factory load our CPU-backend shim of its tiering."""

LMCACHE_CONNECTOR: dict[str, str] = {"kv_connector": "LMCacheCPUConnector", "kv_role": "kv_both",
                                     "kv_connector_module_path": "benchmarks.baselines.lmcache_cpu"}
"""The keys of a kv-transfer-config that load LMCache with our copy half for vLLM's CPU backend."""

BASELINES = "benchmarks.baselines"
"""The package of the baseline connectors' modules (in kvtier's source tree, not installed)."""


@dataclass(frozen=True)
class BenchContext:
    """What the builders need: sizes in engine blocks and chunks, and where files go;
    `block_size` (tokens per engine block) is needed by the lmcache configurations only."""

    block_bytes: int
    device_blocks: int
    all_fits_blocks: int
    host_chunks: int
    work_dir: Path
    options: Mapping[str, str] = field(default_factory=dict)
    block_size: int | None = None

    def option(self, key: str, config: str) -> str:
        value = self.options.get(key)
        if not value:
            raise ValueError(f"configuration {config!r} needs --{key.replace('_', '-')}")
        return value


@dataclass(frozen=True)
class EngineConfig:
    """One configuration, ready to start: device blocks and kvtier's extra config (`kvtier`) or a
    baseline connector's whole kv-transfer-config (`connector`, loading a module of `BASELINES`);
    at most one of the two, neither for vLLM alone."""

    name: str
    device_blocks: int
    kvtier: dict[str, Any] | None
    connector: dict[str, Any] | None = None


def native_connector_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The kv-transfer-config (JSON object) loading vLLM's OffloadingConnector with `extra` (a copy)."""
    return {**NATIVE_CONNECTOR, "kv_connector_extra_config": dict(extra)}


def lmcache_connector_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The kv-transfer-config (JSON object) loading LMCache (`LMCACHE_CONNECTOR`) with `extra`,
    LMCache's settings as `lmcache.<key>` (a copy)."""
    return {**LMCACHE_CONNECTOR, "kv_connector_extra_config": dict(extra)}


def baselines_root() -> Path:
    """The directory to put on the engine's `sys.path` (`PYTHONPATH` for a server) so that the
    baseline connectors (`BASELINES`) import: where they import from now, else kvtier's source tree.
    ValueError when neither has them (kvtier installed without its source tree)."""
    try:
        found = importlib.util.find_spec(BASELINES)
    except ImportError:
        found = None
    if found is not None and found.origin:
        return Path(found.origin).resolve().parents[BASELINES.count(".") + 1]
    tree = Path(__file__).resolve().parents[3]
    if (tree / BASELINES.replace(".", "/") / "__init__.py").is_file():
        return tree
    raise ValueError(f"the vllm-native and lmcache configurations need the baselines {BASELINES} "
                     f"(benchmarks/baselines/ in kvtier's source tree): run from a checkout of "
                     f"kvtier's repository, or put its root on PYTHONPATH")


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


def _host_fs_wait(ctx: BenchContext) -> EngineConfig:
    tiers = [{"type": "fs", "root_dir": str(_fs_dir(ctx, "host+fs-wait"))}]
    raw = {**_host(ctx), "secondary_tiers": tiers, "promotion_wait_s": 0.05}
    return EngineConfig("host+fs-wait", ctx.device_blocks, raw)


def _native(ctx: BenchContext) -> EngineConfig:
    return EngineConfig("vllm-native", ctx.device_blocks, None,
                        native_connector_config({**NATIVE_SPEC, **_host(ctx)}))


def _native_fs(ctx: BenchContext) -> EngineConfig:
    tiers = [{"type": "fs", "root_dir": str(_fs_dir(ctx, "vllm-native+fs"))}]
    return EngineConfig("vllm-native+fs", ctx.device_blocks, None,
                        native_connector_config({**NATIVE_SPEC, **_host(ctx), "secondary_tiers": tiers}))


def _lmcache_settings(ctx: BenchContext, name: str) -> dict[str, Any]:
    """LMCache's local CPU backend of `host`'s bytes (LRU), in chunks of one engine block; no disk
    (set explicitly: LMCache keeps its settings in a process-wide object)."""
    if ctx.block_size is None:
        raise ValueError(f"configuration {name!r} needs the engine's block size (LMCache's chunk size)")
    return {"lmcache.chunk_size": ctx.block_size, "lmcache.local_cpu": True,
            "lmcache.max_local_cpu_size": ctx.host_chunks * ctx.block_bytes / GIB,
            "lmcache.cache_policy": "LRU", "lmcache.local_disk": None, "lmcache.max_local_disk_size": 0.0}


def _lmcache(ctx: BenchContext) -> EngineConfig:
    return EngineConfig("lmcache", ctx.device_blocks, None,
                        lmcache_connector_config(_lmcache_settings(ctx, "lmcache")))


def _lmcache_disk(ctx: BenchContext) -> EngineConfig:
    disk = {"lmcache.local_disk": f"file://{_fs_dir(ctx, 'lmcache+disk')}/",
            "lmcache.max_local_disk_size": ctx.all_fits_blocks * ctx.block_bytes / GIB}
    return EngineConfig("lmcache+disk", ctx.device_blocks, None,
                        lmcache_connector_config({**_lmcache_settings(ctx, "lmcache+disk"), **disk}))


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


def _host_fs_policy(policy: str) -> Callable[[BenchContext], EngineConfig]:
    name = f"host+fs-{policy}"

    def build(ctx: BenchContext) -> EngineConfig:
        tiers = [{"type": "fs", "root_dir": str(_fs_dir(ctx, name))}]
        return EngineConfig(name, ctx.device_blocks,
                            {**_host(ctx), "admission_policy": policy, "secondary_tiers": tiers})
    return build


CONFIGS: dict[str, Callable[[BenchContext], EngineConfig]] = {
    "no-offload": _no_offload,
    "host": _host_only,
    "host+fs": _host_fs,
    "vllm-native": _native,
    "vllm-native+fs": _native_fs,
    "lmcache": _lmcache,
    "lmcache+disk": _lmcache_disk,
    "all-fits": _all_fits,
    "obj": _obj,
    "redis": _redis,
    "admission": _admission,
    "host+fs-frequency": _host_fs_policy("frequency"),
    "host+fs-priority": _host_fs_policy("priority"),
    "host+fs-wait": _host_fs_wait,
}


def check_names(names: list[str]) -> None:
    """ValueError naming an unknown configuration and listing the known ones, saying that the
    baseline connectors cannot be found (`baselines_root`), or that LMCache is not installed."""
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"--configs: unknown configuration {name!r} "
                             f"(known: {', '.join(CONFIGS)})")
    if any(CONFIGS[name] in (_native, _native_fs, _lmcache, _lmcache_disk) for name in names):
        baselines_root()
    lmcache = [name for name in names if CONFIGS[name] in (_lmcache, _lmcache_disk)]
    if lmcache and importlib.util.find_spec("lmcache") is None:
        raise ValueError(f"--configs {','.join(lmcache)}: needs the package lmcache, not installed; "
                         f"install it with scripts/install_lmcache.sh")


def resolve(name: str, ctx: BenchContext) -> EngineConfig:
    """Build configuration `name`; kvtier's part is validated (`KVTierConfig.from_dict`)."""
    check_names([name])
    config = CONFIGS[name](ctx)
    blocks_per_chunk = ctx.options.get("blocks_per_chunk")
    if config.kvtier is not None and blocks_per_chunk:  # `--blocks-per-chunk`: kvtier's chunk size
        config = replace(config, kvtier={**config.kvtier, "blocks_per_chunk": int(blocks_per_chunk)})
    chunk_tokens = ctx.options.get("chunk_tokens")
    if config.kvtier is not None and chunk_tokens:  # `--chunk-tokens`: kvtier's chunk size in tokens
        config = replace(config, kvtier={**config.kvtier, "chunk_tokens": int(chunk_tokens)})
    load_policy = ctx.options.get("load_policy")
    if config.kvtier is not None and load_policy:  # `--load-policy`: load or recompute
        config = replace(config, kvtier={**config.kvtier, "load_policy": load_policy})
    trace_dir = ctx.options.get("trace_dir")
    if config.kvtier is not None and trace_dir:  # `--trace`: one trace file per run
        config = replace(config, kvtier={**config.kvtier,
                                         "trace_path": str(Path(trace_dir) / f"{ctx.work_dir.name}.jsonl")})
    if config.kvtier is not None:
        KVTierConfig.from_dict(config.kvtier)
    return config
