"""Build and load one of our C helpers: compiled once per source version and machine into
`~/.cache/kvtier/native` (published by rename, so concurrent builders never see a partial file).

A helper built for this machine's instruction set (`native_isa`) is keyed by the CPU's model and
flags too, so a cache directory shared by unlike machines never hands one another's build. Without
a C compiler, or with `KVTIER_NATIVE=0`, `compiled` raises OSError and callers keep their Python
path: behaviour is the same either way.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "native"


def _cpu_signature() -> str:
    """The CPU's model name and flags (Linux), else the machine type."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    wanted = ("model name", "flags", "Features")
    lines = sorted({ln for ln in text.splitlines() if ln.split(":")[0].strip() in wanted})
    return platform.machine() + "\n" + "\n".join(lines)


def compiled(source: Path, native_isa: bool = False) -> ctypes.CDLL:
    """`source` built as a shared object (with `-march=native` when `native_isa`) and loaded;
    OSError when it cannot be (no compiler, a failed build, `KVTIER_NATIVE=0`)."""
    if os.environ.get("KVTIER_NATIVE", "1") == "0":
        raise OSError("KVTIER_NATIVE=0")
    flags = ["-O3", "-march=native"] if native_isa else ["-O2"]
    key = hashlib.sha256(source.read_bytes())
    key.update(" ".join(flags).encode())
    if native_isa:
        key.update(_cpu_signature().encode())
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _build(source, target, flags)
    return ctypes.CDLL(str(target))


def _build(source: Path, target: Path, flags: list[str]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", tmp, str(source)],
                                capture_output=True, timeout=60)
        if result.returncode:
            raise OSError(f"{compiler} failed on {source.name}: {result.stderr.decode()[-300:]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise OSError(f"{compiler} timed out on {source.name}") from e
    finally:
        Path(tmp).unlink(missing_ok=True)
