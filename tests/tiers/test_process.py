"""The tier process runner: startup errors, plugins, and a tier that dies or hangs under load."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtier.errors import ConfigError
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, LookupResult, TierContext
from tests.conftest import fill_slot, random_key, settle_lookup, wait_jobs
from tests.tiers.process_helpers import make_proc

PLUGIN = "tests.tiers.plugin_tier"


def test_tier_rejecting_its_options_fails_start_with_its_message(region: HostRegion) -> None:
    proc = make_proc(region, "memory", options={"max_bytes": 1})
    with pytest.raises(ConfigError, match="max_bytes"):
        proc.start()
    assert proc.pid is None


def test_external_tier_loads_by_module_path(region: HostRegion, ctx: TierContext) -> None:
    proc = make_proc(region, "DelayedMemoryTier", PLUGIN, options={"delay_s": 0.05})
    proc.start()
    try:
        assert proc.last_failure is None
        key = random_key()
        data = fill_slot(ctx, 0)
        proc.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
        assert wait_jobs(proc, 1)[0].success
        proc.submit_load(Job(2, JobKind.LOAD, (key,), (1,)))
        assert wait_jobs(proc, 1)[0].success
        assert bytes(ctx.slot_view(1)) == data
    finally:
        proc.shutdown()


def test_killed_tier_fails_in_flight_jobs_and_restarts(region: HostRegion, ctx: TierContext) -> None:
    proc = make_proc(region, "DelayedMemoryTier", PLUGIN, options={"delay_s": 30.0},
                     restart_backoff_s=0.2)
    proc.start()
    try:
        first_pid = proc.pid
        fill_slot(ctx, 0)
        proc.submit_store(Job(1, JobKind.STORE, (random_key(),), (0,)))
        proc.submit_load(Job(2, JobKind.LOAD, (random_key(),), (1,)))
        time.sleep(0.2)
        assert proc.get_finished_jobs() == []
        os.kill(first_pid, signal.SIGKILL)
        start = time.monotonic()
        results = wait_jobs(proc, 2, timeout_s=5)
        assert time.monotonic() - start < 5
        assert sorted(r.job_id for r in results) == [1, 2]
        assert not any(r.success for r in results)
        assert proc.last_failure is not None and proc.last_failure[0] == "exited"
        assert abs(proc.last_failure[1] - time.time()) < 10
        # While down: lookups are misses and new jobs fail at once; nothing blocks.
        assert proc.lookup([random_key()]) == [LookupResult.MISS]
        proc.submit_store(Job(3, JobKind.STORE, (random_key(),), (0,)))
        assert [r.success for r in proc.get_finished_jobs()] == [False]
        deadline = time.monotonic() + 10
        while not proc.is_up and time.monotonic() < deadline:
            proc.get_finished_jobs()
            time.sleep(0.01)
        assert proc.is_up and proc.pid != first_pid and proc.restarts == 1
        assert settle_lookup(proc, [random_key()]) == [LookupResult.MISS]
    finally:
        proc.shutdown()


def test_hung_tier_is_marked_down_after_the_job_timeout(region: HostRegion, ctx: TierContext) -> None:
    proc = make_proc(region, "memory", job_timeout_s=0.5, restart_backoff_s=60)
    proc.start()
    try:
        pid = proc.pid
        os.kill(pid, signal.SIGSTOP)
        fill_slot(ctx, 0)
        proc.submit_store(Job(1, JobKind.STORE, (random_key(),), (0,)))
        start = time.monotonic()
        [result] = wait_jobs(proc, 1, timeout_s=5)
        assert not result.success
        assert 0.4 < time.monotonic() - start < 5
        assert not proc.is_up
        assert proc.last_failure is not None and proc.last_failure[0] == "hung"
        with pytest.raises(ProcessLookupError):
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.02)
    finally:
        proc.shutdown()


def test_backoff_doubles_on_repeated_failures(region: HostRegion) -> None:
    proc = make_proc(region, "memory", restart_backoff_s=0.1)
    proc.start()
    try:
        gaps = []
        for _ in range(3):
            deadline = time.monotonic() + 10
            while not proc.is_up and time.monotonic() < deadline:
                proc.get_finished_jobs()
                time.sleep(0.005)
            assert proc.is_up
            os.kill(proc.pid, signal.SIGKILL)
            while proc.is_up:
                proc.get_finished_jobs()
                time.sleep(0.005)
            down_at = time.monotonic()
            while proc.pid is None:
                proc.get_finished_jobs()
                time.sleep(0.005)
            gaps.append(time.monotonic() - down_at)
        assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.39
        assert proc.restarts == 3
    finally:
        proc.shutdown()


def test_shutdown_is_idempotent_and_reaps_the_process(region: HostRegion) -> None:
    proc = make_proc(region, "memory")
    proc.start()
    pid = proc.pid
    proc.shutdown()
    proc.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_option_error_names_the_tier_entry_and_option(region: HostRegion) -> None:
    proc = make_proc(region, "memory", options={"max_bytes": 5})
    with pytest.raises(ConfigError) as e:
        proc.start()
    assert e.value.key == "secondary_tiers[0].max_bytes" and e.value.value == 5
    assert str(e.value).count("kvtier config") == 1


def test_a_retry_answer_is_asked_again_not_cached(region: HostRegion) -> None:
    proc = make_proc(region, "RetryOnceTier", PLUGIN)
    proc.start()
    try:
        key = random_key()
        answers = []
        deadline = time.monotonic() + proc.lookup_ttl_s / 2
        while LookupResult.HIT not in answers and time.monotonic() < deadline:
            answers = proc.lookup([key])
            time.sleep(0.01)
        assert answers == [LookupResult.HIT], "a tier's RETRY must not stick in the proxy's cache"
    finally:
        proc.shutdown()


def test_a_lookup_waits_once_for_a_stopped_tier(region: HostRegion) -> None:
    proc = make_proc(region, "memory")
    proc.start()
    try:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGSTOP)  # a tier that cannot answer in time
        try:
            assert proc.lookup([random_key()]) == [LookupResult.RETRY]
            start = time.monotonic()
            proc.await_answers(0.3)
            assert time.monotonic() - start >= 0.29  # the fresh question got its wait
            time.sleep(0.05)
            start = time.monotonic()
            proc.await_answers(0.3)
            assert time.monotonic() - start < 0.1  # the same question, now stale, is not waited on
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        key = random_key()
        assert settle_lookup(proc, [key]) == [LookupResult.MISS]
    finally:
        proc.shutdown()
