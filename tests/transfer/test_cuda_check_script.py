"""`scripts/cuda_check.py --device cpu`: the GPU machine's device check, rehearsed on this machine's
CPU with small sizes. What holds: it runs with its own sys.path (no install needed) and without
numpy (the GPU machine's image promises Python and torch only), prints an `ok` row for every kind,
every kind split into kernel blocks, one-block chunks stored by both ranks of TP 2, a load after a
step without stores, and bandwidth rows for one-block chunks at TP 1 and 2; reports the pin time as
not applicable; and exits 0. When the shared-memory directory cannot hold its host regions, it says
so up front, runs nothing else and exits 1."""

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
SMALL += ["--bw16-chunks", "2"]


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_NUMPY, str(SCRIPT), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


def results(stdout: str, check: str) -> dict[str, str]:
    """Kind → result of the table's rows of `check` (columns of 10, 18 and 6 characters)."""
    rows = [line for line in stdout.splitlines() if line[:10].strip() == check]
    return {line[11:29].strip(): line[30:36].strip() for line in rows}


def test_the_device_check_passes_on_the_cpu_for_every_kind(tmp_path: Path) -> None:
    done = run(tmp_path, *SMALL)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    identity = results(out, "identity")
    attention = [kind for kind in GROUP_KINDS if kind != "vllm_cpu"]  # the CPU layout has no CUDA twin
    assert all(identity.get(kind) == "ok" for kind in attention), out
    assert {identity.get(kind) for kind in ("gdn", "mamba2", "gdn_tp2_rank1", "mamba2_tp2_rank1")} == {"ok"}
    assert identity.get("tp2 16tok") == "ok", out
    split = ("flash_hnd", "flash_nhd", "tp2_rank1", "sliding_groups", "mla", "fp8")
    assert results(out, "kernel") == {f"{kind} x4": "ok" for kind in split}, out
    assert results(out, "no stores") == {"flash_nhd": "ok"}, out
    assert results(out, "shm") == {"/dev/shm": "ok"}, out
    assert results(out, "pin time") == {"host region": "skip"} and "not applicable" in out, out
    bandwidth = [line.split()[1:3] for line in out.splitlines() if line.startswith("bandwidth")]
    assert ["16tok", "tp1"] in bandwidth and ["16tok", "tp2"] in bandwidth, out
    assert "all checks passed" in out


def test_a_shm_dir_too_small_for_the_regions_fails_up_front(tmp_path: Path) -> None:
    done = run(tmp_path, *SMALL, "--identity-chunks", str(1 << 30))  # a region of 1 PiB
    assert done.returncode == 1, done.stdout + done.stderr
    assert results(done.stdout, "shm") == {"/dev/shm": "FAIL"}, done.stdout
    assert "cannot hold the check's host regions" in done.stdout and "64 MiB" in done.stdout
    assert not results(done.stdout, "identity") and "nothing else ran" in done.stdout
