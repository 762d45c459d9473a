"""The CI rule of tests/optional.py, run on a small suite of its own in a child pytest: in CI a skip
for anything but a declared optional need fails, at collection and at run time; outside CI every
skip stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import CUDA, OPTIONAL_NEEDS

ROOT = Path(__file__).resolve().parents[1]

SUITE = {
    "test_run.py": '''
import pytest
from tests.optional import CUDA

@pytest.fixture
def server():
    pytest.skip("redis-server is not installed")

def test_needs_a_server(server):
    pass

@pytest.mark.skipif(True, reason="no prometheus binary")
def test_marked():
    pass

@CUDA.skipif(True)
def test_on_a_gpu():
    pass

def test_skips_for_cuda_inside():
    CUDA.skip()

@pytest.mark.xfail(reason="a known bug")
def test_known_bug():
    assert False

def test_runs():
    pass
''',
    "test_collected.py": '''
import pytest
pytest.importorskip("kvtier_no_such_module")

def test_never_collected():
    pass
''',
}


def run_suite(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.optional", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", "-q", "-rA", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_in_ci_a_skip_for_a_needed_thing_fails_naming_its_reason(tmp_path: Path, ci: str) -> None:
    done = run_suite(tmp_path, ci)
    out = done.stdout
    assert done.returncode == 1, out
    assert "skipped in CI: redis-server is not installed" in out
    assert "skipped in CI: no prometheus binary" in out
    assert "skipped in CI: could not import 'kvtier_no_such_module'" in out
    assert "PASSED test_run.py::test_runs" in out
    assert "XFAIL test_run.py::test_known_bug" in out
    assert out.count(f": {CUDA.reason}") == 2  # both optional skips stay skips
    assert "1 passed, 2 skipped, 1 xfailed, 3 errors" in out


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_outside_ci_every_skip_stays_a_skip(tmp_path: Path, ci: str | None) -> None:
    done = run_suite(tmp_path, ci)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 5 skipped, 1 xfailed" in done.stdout


def test_each_optional_need_has_its_own_reason_and_says_why() -> None:
    reasons = [need.reason for need in OPTIONAL_NEEDS]
    assert len(set(reasons)) == len(reasons)
    assert all(need.reason.strip() and need.why.strip() for need in OPTIONAL_NEEDS)
