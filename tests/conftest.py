"""Shared fixtures: host regions, tier contexts, and helpers that drive tiers to completion."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from kvtier.format.chunks import ChunkKey
from kvtier.host import generations
from kvtier.host.region import HostRegion
from kvtier.integrations.vllm.serving.launch import SHARED_CACHE_ROOT
from kvtier.tiers.base import JobResult, LookupResult, TierContext

pytest_plugins = [
    "tests.optional", "tests.early_start", "tests.gc_freeze", "tests.services.redis_server",
    "tests.services.s3",
]

# The suite starts vLLM engines in this process after `kvtier plan` ran here: keep numba (and
# llvmlite) out of it (see kvtier.trace.mrc); the compiled path is tested in a child process.
os.environ["KVTIER_NUMBA"] = "0"
# Every engine here runs eager (`enforce_eager`, `--enforce-eager`), yet vLLM still compiles one
# sampler helper with torch.compile, the rank of each sampled token among its logits
# (`vllm.v1.sample.ops.logprobs.batched_count_greater_than`), the first time a process samples with
# logprobs: 8-25 s of tracing and inductor C++ builds per fresh process on 2 cores, paid again by
# every engine child (`engine_child`, servers). Run eagerly it counts the same integers. The
# variable reaches this process's engines and every child the suite starts (they inherit it).
os.environ["TORCH_COMPILE_DISABLE"] = "1"

ROW_BYTES = 3 * 4096
SLOTS = 32
LAYOUT_FP = "00112233445566778899aabbccddeeff"
T = TypeVar("T")


VLLM_CACHE = Path.home() / ".cache" / "kvtier" / "vllm"
# Every engine the suite starts, in-process or in a child (servers, benchmarks, the demo, the chaos
# campaign), uses one vLLM cache root, `~/.cache/kvtier/vllm` unless `KVTIER_VLLM_CACHE_ROOT` names
# another (read by `launch.isolated_env`; children inherit it), kept between runs like the test
# models beside it: a process whose cache root lacks the record of a model class (its `modelinfos/`
# file, keyed by a digest of the class's source files) inspects the class in a fresh subprocess
# that imports vLLM, about 7 s on 2 cores, once per class on this machine rather than once per run.
# Nothing else lands there: every engine here runs eager, with torch.compile off.
if not os.environ.get(SHARED_CACHE_ROOT):
    VLLM_CACHE.mkdir(parents=True, exist_ok=True)
    os.environ[SHARED_CACHE_ROOT] = str(VLLM_CACHE)


@pytest.fixture
def region() -> Iterator[HostRegion]:
    r = HostRegion.create(ROW_BYTES * SLOTS + generations.nbytes(SLOTS))
    yield r
    r.close()


@pytest.fixture
def ctx(region: HostRegion) -> TierContext:
    return TierContext(
        region=region.buf, row_bytes=ROW_BYTES, num_slots=SLOTS,
        layout_fingerprint=LAYOUT_FP, tier_name="test",
        generations=generations.view(region.buf, ROW_BYTES * SLOTS, SLOTS),
    )


def random_key() -> ChunkKey:
    return secrets.token_bytes(32)


def fill_slot(ctx: TierContext, slot: int) -> bytes:
    data = os.urandom(ctx.row_bytes)
    ctx.slot_view(slot)[:] = data
    return data


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 10.0,
               interval_s: float = 0.005) -> T:
    """Poll `condition` until it returns a true value, and return that value; fails the test,
    saying `what` was awaited, if `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)
    return value


def wait_jobs(tier, n: int, timeout_s: float = 10.0) -> list[JobResult]:
    """Poll `tier.get_finished_jobs()` until `n` results arrived (fails the test on timeout)."""
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < n:
        results.extend(tier.get_finished_jobs())
        if time.monotonic() > deadline:
            pytest.fail(f"only {len(results)} of {n} jobs finished within {timeout_s} s")
        time.sleep(0.002)
    return results


def settle_lookup(tier, keys, timeout_s: float = 10.0) -> list[LookupResult]:
    """Repeat an asynchronous lookup until no key answers RETRY."""
    deadline = time.monotonic() + timeout_s
    while True:
        answers = tier.lookup(keys)
        if LookupResult.RETRY not in answers:
            return answers
        if time.monotonic() > deadline:
            pytest.fail("lookup still RETRY after timeout")
        time.sleep(0.002)
