"""How kvtier's callers start vLLM: the connector's transfer config and an isolated environment.

`connector_config(extra)` is the `--kv-transfer-config` JSON object that loads the KVTierConnector
with kvtier's `kv_connector_extra_config`; `transfer_config(extra)` is the same as vLLM's
`KVTransferConfig`, for an in-process `LLM(kv_transfer_config=...)`. vLLM is imported only by
`transfer_config`, so this module imports on a machine without it.

`isolated_env(tmp_dir, in_process=...)` gives the environment variables that keep one vLLM
engine's temp files, sockets and caches under `tmp_dir` and off the network; a caller that starts
a server adds them to a copy of `os.environ`, and `in_process_env(tmp_dir)` sets them in this
process (and `tempfile.tempdir`) for the duration of a `with` block.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig

CONNECTOR: dict[str, str] = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
"""The keys of a kv-transfer-config that load kvtier's connector, in both roles. A chunk whose
load fails is recomputed (vLLM's default policy, "fail", would fail its request)."""


def connector_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The kv-transfer-config (JSON object) loading the KVTierConnector with kvtier's config
    `extra` (a copy) as its `kv_connector_extra_config`."""
    return {**CONNECTOR, "kv_connector_extra_config": dict(extra)}


def transfer_config(extra: Mapping[str, Any]) -> KVTransferConfig:
    """`connector_config(extra)` as vLLM's `KVTransferConfig`, for an in-process engine."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**connector_config(extra))


SHARED_CACHE_ROOT = "KVTIER_VLLM_CACHE_ROOT"


def isolated_env(tmp_dir: Path, *, in_process: bool) -> dict[str, str]:
    """The variables that isolate one vLLM engine (to set on top of the current environment):

    - `TMPDIR`, `VLLM_RPC_BASE_PATH`: temp files and the engine's IPC sockets go under `tmp_dir`
      (vLLM leaves socket files behind, and two engines never share a path);
    - `VLLM_CACHE_ROOT`, `HF_HOME`: vLLM's and Hugging Face's caches under `tmp_dir`, so nothing
      read comes from, or is written to, the user's caches; vLLM's is `$KVTIER_VLLM_CACHE_ROOT`
      instead when that is set, one cache for every engine a test suite or a benchmark campaign
      starts (an engine whose cache lacks the record of its model class inspects the class in a
      subprocess that imports vLLM, about 12 s on 2 cores);
    - `HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`: the model is a local directory, never downloaded;
    - `VLLM_NO_USAGE_STATS`, `DO_NOT_TRACK`: no usage report leaves the machine;
    - with `in_process`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`: `LLM(...)` runs its engine core in the
      calling process (both connector halves in one process, no engine subprocess).
    """
    env = {
        "TMPDIR": str(tmp_dir),
        "VLLM_RPC_BASE_PATH": str(tmp_dir),
        "VLLM_CACHE_ROOT": os.environ.get(SHARED_CACHE_ROOT) or str(tmp_dir / "vllm-cache"),
        "HF_HOME": str(tmp_dir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


@contextlib.contextmanager
def in_process_env(tmp_dir: Path) -> Iterator[Path]:
    """Within the block, `isolated_env(tmp_dir, in_process=True)` is set in `os.environ` and
    `tempfile.tempdir` is `tmp_dir`; both are restored on exit. Enter it before vLLM is imported
    (vLLM reads some of these variables at import time)."""
    env = isolated_env(tmp_dir, in_process=True)
    saved = {key: os.environ.get(key) for key in env}
    saved_tempdir = tempfile.tempdir
    os.environ.update(env)
    tempfile.tempdir = str(tmp_dir)
    try:
        yield tmp_dir
    finally:
        tempfile.tempdir = saved_tempdir
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
