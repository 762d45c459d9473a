"""Order of the run, and slow tests whose work is one long command run beside the fast tests.

The fast tests run first, then the slow ones (a failure in a unit shows in a minute or two). A slow
test marked `early_start(argv_of=..., timeout_s=...)` is one command of its own, such as a soak of
fixed duration or a benchmark's smoke run: the command (`argv_of(work_dir)`, run from the
repository root, its output in `work_dir`) runs beside the fast tests, which leave a core mostly
idle while they wait on processes and sockets. The commands run one after another, longest
`timeout_s` first (a short one is then what the slow tests may have to wait for), the first as
collection ends, each next one as a test ends after the last one exited: one at a time, as more
starve the fast tests that time a tier process's restart. As the first slow test begins, the
command running then is waited for and no other starts: the engine tests run alone. A command not
started by then starts when its own test runs.

The tests themselves move to the end of the run, wait for their command (`early_run.finish()`) and
check what it printed, every assertion as if they had started it themselves. A command still
running `timeout_s` after it started is killed with its process group, and so is whatever runs when
the session ends; each `work_dir` is removed then. Nothing starts under `--collect-only`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Started:
    """An `early_start` command: its process, the directory holding its work and output, and when
    it must have ended."""

    proc: subprocess.Popen[bytes]
    work_dir: Path
    deadline: float

    def wait(self) -> None:
        """Wait for the command to exit, killing it at its deadline."""
        try:
            self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()

    def finish(self) -> subprocess.CompletedProcess[str]:
        """Wait for the command and return what it printed (killed at its deadline: code -9)."""
        self.wait()
        out = (self.work_dir / "stdout").read_text(errors="replace")
        err = (self.work_dir / "stderr").read_text(errors="replace")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def running_with(marker: str) -> list[int]:
    """The live processes whose command line contains `marker` (what a command left running)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@dataclass
class _Chain:
    """The marked tests whose commands have not started, the one running, and whether the fast
    tests still run (commands start only then)."""

    waiting: list[pytest.Item] = field(default_factory=list)
    running: Started | None = None
    beside_fast_tests: bool = True


EARLY = pytest.StashKey[Started]()
UNSTARTED = pytest.StashKey[str]()
CHAIN = pytest.StashKey[_Chain]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "early_start(argv_of=..., timeout_s=...): the test's command runs beside the "
        "fast tests; the test runs last and checks it (tests/early_start.py)")


def _order(item: pytest.Item) -> tuple[bool, bool, float]:
    """Fast tests, then slow ones, then the `early_start` ones, longest bound first."""
    early = item.get_closest_marker("early_start")
    return (early is not None, item.get_closest_marker("slow") is not None,
            -float(early.kwargs["timeout_s"]) if early is not None else 0.0)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_order)


def _start(item: pytest.Item) -> Started | None:
    """Start `item`'s command; None (the reason stashed for its test) if its argv cannot be made."""
    mark = item.get_closest_marker("early_start")
    assert mark is not None
    argv_of: Callable[[Path], list[str]] = mark.kwargs["argv_of"]
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-early-"))
    try:
        argv = argv_of(work_dir)
    except Exception as e:  # the test reports it: the rest of the run goes on
        item.stash[UNSTARTED] = f"{argv_of.__name__}: {e!r}"
        shutil.rmtree(work_dir, ignore_errors=True)
        return None
    with (work_dir / "stdout").open("wb") as out, (work_dir / "stderr").open("wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
    started = Started(proc, work_dir, time.monotonic() + float(mark.kwargs["timeout_s"]))
    item.stash[EARLY] = started
    return started


def _advance(chain: _Chain) -> None:
    """Start the next waiting command if the fast tests still run and none is running."""
    while chain.beside_fast_tests and chain.waiting and (
            chain.running is None or chain.running.proc.poll() is not None):
        chain.running = _start(chain.waiting.pop(0))


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    chain = _Chain([item for item in session.items if item.get_closest_marker("early_start")])
    session.config.stash[CHAIN] = chain
    _advance(chain)


def pytest_runtest_setup(item: pytest.Item) -> None:
    chain = item.config.stash.get(CHAIN, None)
    if chain is None or not chain.beside_fast_tests or item.get_closest_marker("slow") is None:
        return
    chain.beside_fast_tests = False
    if chain.running is not None:
        chain.running.wait()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    chain = item.config.stash.get(CHAIN, None)
    if chain is not None:
        _advance(chain)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for item in session.items:
        started = item.stash.get(EARLY, None)
        if started is not None:
            started.kill()
            shutil.rmtree(started.work_dir, ignore_errors=True)


@pytest.fixture
def early_run(request: pytest.FixtureRequest) -> Started:
    """The test's `early_start` command: the one that ran beside the fast tests, or started now if
    the fast tests ended before its turn came."""
    item = request.node
    chain = item.config.stash.get(CHAIN, None)
    started: Started | None = item.stash.get(EARLY, None)
    if started is None and chain is not None and item in chain.waiting:
        chain.waiting.remove(item)
        started = _start(item)
    if started is None:
        why = item.stash.get(UNSTARTED, "the test is not marked early_start")
        pytest.fail(f"the command did not start: {why}")
    return started
