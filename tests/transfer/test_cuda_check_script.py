"""`scripts/cuda_check.py --device cpu`: the GPU machine's device check, rehearsed on this machine's
CPU with small sizes. What holds: it runs with its own sys.path (no install needed) and without
numpy (the GPU machine's image promises Python and torch only), prints an `ok` row for every kind,
and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.transfer.helpers import GROUP_KINDS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_check.py"
WITHOUT_NUMPY = """
import runpy, sys
class HideNumpy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "numpy":
            raise ModuleNotFoundError("numpy is hidden", name=name)
sys.meta_path.insert(0, HideNumpy())
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])  # as when the script runs itself
runpy.run_path(sys.argv[0], run_name="__main__")
"""
SMALL = ["--identity-chunks", "2", "--bw-chunks", "1", "--bw-layers", "2", "--bw-bpc", "2"]


def test_the_device_check_passes_on_the_cpu_for_every_kind(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_NUMPY, str(SCRIPT), "--device", "cpu", *SMALL],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {
        line.split()[1]: line.split()[2] for line in done.stdout.splitlines() if line.startswith("identity")
    }
    attention = [kind for kind in GROUP_KINDS if kind != "vllm_cpu"]  # the CPU layout has no CUDA twin
    assert all(rows.get(kind) == "ok" for kind in attention), done.stdout
    assert {rows.get(kind) for kind in ("gdn", "mamba2", "gdn_tp2_rank1", "mamba2_tp2_rank1")} == {"ok"}
    assert "all checks passed" in done.stdout
