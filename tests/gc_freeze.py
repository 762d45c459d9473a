"""vLLM's modules kept out of the test process's garbage collections.

With vLLM, torch and transformers imported, a full garbage collection walks about 700,000
long-lived objects (their modules, classes and functions): a quarter to half a second on 2 cores.
vLLM's engine core runs such collections as every in-process engine starts (it freezes the heap
then, `freeze_gc_heap`) and again as it shuts down (it unfreezes everything and collects,
`cleanup_dist_env_and_memory`), and the interpreter runs more as objects pile up: in this suite, a
fifth of an in-process engine test's time.

Before the first slow test runs (the fast ones run first, `early_start.py`), vLLM's engine modules
are imported, what is garbage is collected, and every object left is frozen (`gc.freeze`): the
imports and the session's own fixtures. The engine core's own freeze and unfreeze then leave that
frozen set alone (the `gc` of vLLM's modules that freeze or unfreeze ignores both calls), so its
collections walk only what was made after the imports: the engines themselves, whose cycles are
still collected once they are dropped, as vLLM's unfreeze means them to be. The set is unfrozen
when the run ends. Engines in child processes (servers, `engine_child`) are untouched.
"""

from __future__ import annotations

import gc
import importlib
from typing import Any

import pytest

UNFREEZING = ("vllm.v1.engine.core", "vllm.v1.worker.gpu_worker", "vllm.distributed.parallel_state")
"""vLLM's modules that unfreeze the heap (an engine core's, a worker's shutdown, the teardown of the
distributed state); the CPU backend's worker is a subclass of the GPU one."""
_FROZEN = pytest.StashKey[bool]()


class _SessionFrozen:
    """`gc` as vLLM's engine core sees it: freezing and unfreezing do nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)

    @staticmethod
    def freeze() -> None:
        return None

    @staticmethod
    def unfreeze() -> None:
        return None


def freeze_imports() -> bool:
    """Import vLLM's engine modules, make their freezes and unfreezes do nothing, collect and freeze
    what is left; False (and nothing done) where vLLM is not installed."""
    try:
        modules = [importlib.import_module(name) for name in ("vllm", *UNFREEZING)]
    except ImportError:
        return False
    for module in modules[1:]:
        module.gc = _SessionFrozen()
    modules[1].freeze_gc_heap = lambda: None
    gc.collect()
    gc.freeze()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if config.stash.get(_FROZEN, False) or item.get_closest_marker("slow") is None:
        return
    config.stash[_FROZEN] = True
    freeze_imports()  # no vLLM here: its tests skip, and there is nothing big to freeze


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_FROZEN, False):
        gc.unfreeze()
