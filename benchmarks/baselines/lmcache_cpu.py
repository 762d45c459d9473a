"""LMCache (0.5.6) on vLLM's CPU backend: the connector to load, with the copy half it lacks there.

LMCache's vLLM connector builds its engine's "GPU connector" (the copies between vLLM's paged KV
cache and LMCache's memory objects) with `lmcache.v1.gpu_connector.CreateGPUConnector`, which knows
CUDA, XPU, MUSA and HPU and raises "No supported cpu connector found" on vLLM's CPU backend. LMCache
catches that, logs it once and runs "degraded": it stores nothing and every lookup misses, so an
engine configured with it silently recomputes everything.

`LMCacheCPUConnector` is vLLM's `LMCacheConnectorV1` unchanged except that, before LMCache builds
its engine, `install` makes `CreateGPUConnector` answer our `HostPagedConnector`
(`benchmarks/baselines/lmcache_copy.py`) on the CPU backend; every other device keeps LMCache's own
choice. The rest of LMCache runs as it is: its chunk hashing, lookup server, local CPU backend
(LRU), local disk backend, and its stores.

Loaded by vLLM with `kv_connector_module_path` (the repository root on `sys.path` / `PYTHONPATH`);
LMCache reads its settings from the extra config's `lmcache.` keys::

    {"kv_connector": "LMCacheCPUConnector", "kv_role": "kv_both",
     "kv_connector_module_path": "benchmarks.baselines.lmcache_cpu",
     "kv_connector_extra_config": {"lmcache.chunk_size": 64, "lmcache.local_cpu": true,
                                   "lmcache.max_local_cpu_size": 1.0}}

LMCache is imported only inside `install` (see `lmcache_copy` for why). Once it is imported, a
later engine in the same process would still fail in that scan (vLLM reads `vars()` of every module
attribute, and llvmlite's `ffi.lib` answers any attribute, `__dict__` included, with a function
wrapper): `install` makes that object refuse dunder names, so a sweep can start engine after
engine in one process. Install LMCache beside vLLM with `scripts/install_lmcache.sh` (a
benchmark-only dependency).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1


def install() -> None:
    """Make LMCache's `CreateGPUConnector` answer a `HostPagedConnector` for vLLM on the CPU
    backend; other devices and engines keep LMCache's own. Idempotent."""
    from lmcache.utils import EngineType
    from lmcache.v1 import gpu_connector

    from benchmarks.baselines.lmcache_copy import HostPagedConnector

    create = gpu_connector.CreateGPUConnector
    if getattr(create, "host_paged", False):
        return
    _hide_llvmlite_dunders()

    def create_connector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if engine == EngineType.VLLM and gpu_connector.torch_device_type == "cpu":
            return HostPagedConnector(metadata)
        return create(config, metadata, engine, layout_hints=layout_hints)

    create_connector.host_paged = True  # type: ignore[attr-defined]
    gpu_connector.CreateGPUConnector = create_connector


def _hide_llvmlite_dunders() -> None:
    """Make llvmlite's `ffi.lib` raise AttributeError for dunder names instead of answering them
    with a function wrapper (see the module docstring); its functions are unchanged."""
    from llvmlite.binding import ffi

    cls = type(ffi.lib)
    lookup = cls.__getattr__

    def getattr_no_dunders(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    cls.__getattr__ = getattr_no_dunders


class LMCacheCPUConnector(LMCacheConnectorV1):
    """vLLM's LMCache connector, with `install` done before LMCache builds its engine, and a
    `shutdown` that stops LMCache."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        install()
        super().__init__(vllm_config, role, kv_cache_config)

    def shutdown(self) -> None:
        """Close LMCache's engine (its storage manager's event loop is the one thread that keeps a
        process alive) when vLLM shuts the scheduler or the worker down; a no-op for a role with
        no engine. vLLM's `LMCacheConnectorV1` does not pass shutdown on, so a process that ran an
        engine in it would never exit; LMCache's own `shutdown` first closes its ZMQ servers'
        sockets under the threads still receiving on them, which can abort the process (a libzmq
        assertion), so only the engine is closed: those threads are daemons."""
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        factory = self._lmcache_engine._manager._service_factory
        LMCacheEngineBuilder.destroy(factory.get_engine_instance_id())
