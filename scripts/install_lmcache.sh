#!/usr/bin/env bash
# Install LMCache beside vLLM in .venv, for the benchmark's lmcache configurations only (not part
# of `make setup` or the tests' path: a benchmark-only dependency).
#
# LMCache 0.5.6 pins packages that would move vLLM's (torch among them), so it goes in with
# --no-deps, followed by the few of its imports that vLLM does not already bring: sortedcontainers
# (its LRU), aiofile, aiofiles and caio (its local disk backend). numba, which it also imports,
# comes with vLLM. Its copy half for vLLM's CPU backend is ours: benchmarks/baselines/lmcache_cpu.py.
#
# Idempotent: when that version already imports, it does nothing (a second run takes about a second).
# Environment: VENV (default .venv at the repository root).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
VPY="$VENV/bin/python"
LMCACHE_VERSION="0.5.6"
DEPS=(sortedcontainers aiofile aiofiles caio)

if [[ ! -x "$VPY" ]]; then
    echo "install_lmcache: no virtual environment at $VENV (run make setup first)" >&2
    exit 1
fi

if "$VPY" - "$LMCACHE_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata, sys
import aiofile, aiofiles, caio, sortedcontainers  # noqa: F401
sys.exit(importlib.metadata.version("lmcache") != sys.argv[1])
EOF
then
    echo "install_lmcache: lmcache $LMCACHE_VERSION already installed in $VENV"
    exit 0
fi

"$VPY" -m pip install --quiet --no-deps --no-warn-conflicts "lmcache==$LMCACHE_VERSION"
"$VPY" -m pip install --quiet --no-warn-conflicts "${DEPS[@]}"
"$VPY" -c "import importlib.metadata as m; print('install_lmcache: lmcache', m.version('lmcache'), 'installed')"
