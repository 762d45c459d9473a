"""Order of the run, and slow tests whose work is one long command started as the run begins.

The fast tests run first, then the slow ones (a failure in a unit shows in a minute or two). A slow
test marked `early_start(argv_of=...)` is one command of its own, such as a soak of fixed duration:
the command (`argv_of(work_dir)`, run from the repository root, its output in `work_dir`) starts
when collection ends and runs beside the rest of the suite, whose fast tests leave a core mostly
idle (one such command at a time: more starve the fast tests that time a tier process's restart).
The test itself moves to the end of the run, waits for the command (`early_run(...)`) and checks
what it printed, every assertion as if it had started the command itself. Whatever is still
running when the session ends is killed with its process group, and `work_dir` removed. Nothing
starts under `--collect-only`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Started:
    """An `early_start` command: its process and the directory holding its work and output."""

    proc: subprocess.Popen[bytes]
    work_dir: Path

    def finish(self, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Wait for the command (killed past `timeout_s`) and return what it printed."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        out = (self.work_dir / "stdout").read_text(errors="replace")
        err = (self.work_dir / "stderr").read_text(errors="replace")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


EARLY = pytest.StashKey[Started]()
UNSTARTED = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "early_start(argv_of=...): the test's command starts when collection ends; the "
        "test runs last and checks it (tests/early_start.py)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: (item.get_closest_marker("early_start") is not None,
                                 item.get_closest_marker("slow") is not None))


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        mark = item.get_closest_marker("early_start")
        if mark is None:
            continue
        argv_of: Callable[[Path], list[str]] = mark.kwargs["argv_of"]
        work_dir = Path(tempfile.mkdtemp(prefix="kvtier-early-"))
        try:
            argv = argv_of(work_dir)
        except Exception as e:  # the test reports it: the rest of the run goes on
            item.stash[UNSTARTED] = f"{argv_of.__name__}: {e!r}"
            shutil.rmtree(work_dir, ignore_errors=True)
            continue
        with (work_dir / "stdout").open("wb") as out, (work_dir / "stderr").open("wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        item.stash[EARLY] = Started(proc, work_dir)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for item in session.items:
        started = item.stash.get(EARLY, None)
        if started is not None:
            started.kill()
            shutil.rmtree(started.work_dir, ignore_errors=True)


@pytest.fixture
def early_run(request: pytest.FixtureRequest) -> Started:
    """The test's `early_start` command, started when collection ended."""
    started: Started | None = request.node.stash.get(EARLY, None)
    if started is None:
        why = request.node.stash.get(UNSTARTED, "the test is not marked early_start")
        pytest.fail(f"the command did not start: {why}")
    return started
