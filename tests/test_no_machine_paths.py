"""Tracked results and docs name no development machine's paths.

A raw JSON file, a benchmark script or a page that says `/root/.cache/...`, `/home/NAME/...`,
`/work/...` or `/tmp/run-3/...` names the machine it was written on: meaningless to a reader, and
different on the next machine. Results are written through `kvtier.bench.neutral_paths` (`~` for
the home directory, temp and working-tree paths relative); pages use `~/...`, a relative name
(`bench-results/...`) or a generic path.

What is allowed, because it names no one's machine: generic system paths (`/dev/shm`, `/proc/...`,
`/mnt/kv`, `/var/tmp/...`), and `/tmp` alone, as prose about TMPDIR's default says it. A path only
counts where it starts (so `/var/tmp/x` is not `/tmp/x`).

The files scanned: tracked `benchmarks/results/*.json`, `benchmarks/*.py`, every tracked file under
`docs/` that is text, and every tracked Markdown file (BENCHMARKS.md, README.md, ...).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:root|home|work|tmp)/[^\s\"'`)\],]+")
SCANNED = ("benchmarks/results/*.json", "benchmarks/*.py", "docs/*", "*.md")


def scanned_files() -> list[Path]:
    """The tracked files this test reads (see the module docstring); binary files left out."""
    names = subprocess.run(["git", "ls-files", "--", *SCANNED], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    files = [ROOT / n for n in names if n]
    return [f for f in files if f.is_file() and b"\0" not in f.read_bytes()[:8192]]


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of each machine path in `text`."""
    return [(number, m.group(0)) for number, line in enumerate(text.splitlines(), 1)
            for m in MACHINE_PATH.finditer(line)]


def test_the_scan_tells_machine_paths_from_generic_ones() -> None:
    found = machine_paths('"model": "/root/.cache/kvtier/models/m",\n--out /tmp/i27b/mt_fs '
                          "--lock=/work/wt/load.lock\n(`/home/someone/kv`)")
    assert found == [(1, "/root/.cache/kvtier/models/m"), (2, "/tmp/i27b/mt_fs"),
                     (2, "/work/wt/load.lock"), (3, "/home/someone/kv")]
    generic = ("/dev/shm/kvtier-1 /proc/PID/cmdline /mnt/kv /var/tmp/kvtier-bench-1 "
               "TMPDIR (/tmp by default) ~/.cache/kvtier bench-results/tmp/x a/work/b")
    assert machine_paths(generic) == []


def test_tracked_results_and_docs_name_no_machine_path() -> None:
    files = scanned_files()
    assert any(f.suffix == ".json" for f in files) and (ROOT / "BENCHMARKS.md") in files
    found = [f"{f.relative_to(ROOT)}:{number}: {path}" for f in files
             for number, path in machine_paths(f.read_text(errors="replace"))]
    assert found == [], "machine paths in tracked files (write ~/..., a relative name or a " \
                        "generic path):\n" + "\n".join(found)
