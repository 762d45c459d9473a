"""Fixtures of the host tier's tests: a mapped buffer of 64 rows, and every built-in eviction
policy by name."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest

from kvtier.policies.registry import BUILTIN_EVICTION
from tests.host.helpers import ROW


@pytest.fixture
def buf() -> Iterator[memoryview]:
    m = mmap.mmap(-1, ROW * 64)
    view = memoryview(m)
    yield view
    view.release()
    m.close()


@pytest.fixture(params=sorted(BUILTIN_EVICTION))
def policy_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)
