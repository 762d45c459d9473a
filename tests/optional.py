"""What the suite may go without in CI, each with why, and the rule that fails every other skip.

Outside CI a test that lacks something it needs (a redis or Valkey server, SeaweedFS, Prometheus,
vLLM, Dynamo's indexer, a C compiler, `openssl`) skips and says what: a developer's machine need not
hold everything. In CI (`CI` set in the environment to anything but "", "0" or "false"; `.ci/run`
exports CI=true) `make setup` has installed all of it, so a skip means a test that should have run
did not, and the run would pass without it: there a skip fails the test, naming its reason, unless
the reason is one of the optional needs below, which a CI machine may lack by nature. The rule
holds for skips at collection (a module's `pytest.skip(..., allow_module_level=True)` or
`importorskip`) and at run time (`skipif` marks, `pytest.skip` in a test or a fixture); xfails
are left alone.

A test that skips for an optional need gives that need's reason, through `OptionalNeed.skipif`
or `OptionalNeed.skip`, so that the reason it prints is the one declared here.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from dataclasses import dataclass
from typing import NoReturn

import pytest


@dataclass(frozen=True)
class OptionalNeed:
    """Something a CI machine may lack: `reason` is the skip reason its tests give, `why` says why
    a run without it still checks what it must."""

    reason: str
    why: str

    def skipif(self, missing: bool) -> pytest.MarkDecorator:
        """A mark that skips the test (or module, as `pytestmark`) where `missing` holds."""
        return pytest.mark.skipif(missing, reason=self.reason)

    def skip(self) -> NoReturn:
        """Skip the calling test (or fixture) now; the report names the caller's line."""
        __tracebackhide__ = True
        pytest.skip(self.reason)


CUDA = OptionalNeed(
    "needs a CUDA device",
    why="CI machines have no GPU. The CUDA copy path's ordering and bytes are checked on CPUs "
        "through an emulated device (tests/transfer/test_stream_*.py); on a machine with a GPU these "
        "tests run, and scripts/cuda_check.py measures the bandwidth.",
)
LMCACHE = OptionalNeed(
    "lmcache is not installed (scripts/install_lmcache.sh installs it)",
    why="LMCache is a baseline the benchmarks compare kvtier with, not a part of kvtier: `make "
        "setup` does not install it (scripts/install_lmcache.sh does, with --no-deps beside vLLM).",
)
FP8_CPU_KERNELS = OptionalNeed(
    "vLLM's CPU backend runs an fp8 KV cache only on x86 with AVX-512 or AMX",
    why="a property of the processor, not of the setup: CI lands on AVX2-only machines too. "
        "kvtier's fp8 rows are checked without vLLM's kernels (tests/transfer, "
        "tests/integrations/test_kv_dtype.py); only vLLM's fp8 engine on CPU needs AVX-512 or AMX.",
)
NATIVE_OFF = OptionalNeed(
    "KVTIER_NATIVE=0",
    why="whoever runs the suite with KVTIER_NATIVE=0 turned kvtier's compiled helpers off on "
        "purpose, to run every copy and store through the Python path; the tests of the compiled "
        "code have nothing to test then. CI leaves the variable unset.",
)

OPTIONAL_NEEDS = (CUDA, LMCACHE, FP8_CPU_KERNELS, NATIVE_OFF)
"""Every need a CI run may go without: nothing else may skip there."""

_OPTIONAL_REASONS = frozenset(need.reason for need in OPTIONAL_NEEDS)
_SKIPPED = "Skipped: "
"""How pytest prefixes the message of a skip raised by `pytest.skip`."""


def in_ci() -> bool:
    """Whether this run is a CI run (`CI` set, and not to "", "0" or "false")."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def skip_reason(longrepr: object) -> str:
    """The reason of a skip report's `longrepr` (a (path, line, message) tuple), without pytest's
    "Skipped: " prefix."""
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(message).removeprefix(_SKIPPED)


def _fail_unless_optional(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn a skip `report` into a failure that names its reason, unless the reason is optional."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report.longrepr)
    if reason in _OPTIONAL_REASONS:
        return
    where = ""
    if isinstance(report.longrepr, tuple):
        where = f"{report.longrepr[0]}:{report.longrepr[1]}: "
    report.outcome = "failed"
    report.longrepr = (f"{where}skipped in CI: {reason}\nIn CI only the optional needs of "
                       "tests/optional.py may be missing; install this one (make setup).")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[
        None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if in_ci():
        _fail_unless_optional(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[
        None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if in_ci():
        _fail_unless_optional(report)
    return report
