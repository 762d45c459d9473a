"""The tier process runner: startup errors, plugins, and a tier that dies or hangs under load."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest

from kvtier.errors import ConfigError
from kvtier.host.region import HostRegion
from kvtier.tiers.base import Job, JobKind, LookupResult, TierContext
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.messages import EventsReport, JobsDone, read_message
from kvtier.tiers.process import TierProcess
from kvtier.tiers.runner import _flush
from tests.conftest import fill_slot, random_key, settle_lookup, wait_jobs, wait_until
from tests.tiers.process_helpers import make_proc, report_now

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
        assert first_pid is not None
        fill_slot(ctx, 0)
        proc.submit_store(Job(1, JobKind.STORE, (random_key(),), (0,)))
        proc.submit_load(Job(2, JobKind.LOAD, (random_key(),), (1,)))
        report_now(proc)  # the tier took both jobs (its report follows them) and holds them
        assert proc.last_usage is not None and proc.last_usage.chunks == 1
        assert proc.get_finished_jobs() == []
        killed_at = time.time()
        os.kill(first_pid, signal.SIGKILL)
        results = wait_jobs(proc, 2)
        assert sorted(r.job_id for r in results) == [1, 2]
        assert not any(r.success for r in results)
        # Its exit, not the job timeout (60 s), failed them; the failure is stamped in Unix time.
        assert proc.last_failure is not None and proc.last_failure[0] == "exited"
        assert killed_at <= proc.last_failure[1] <= time.time()
        # While down: lookups are misses and new jobs fail at once; nothing blocks.
        assert proc.lookup([random_key()]) == [LookupResult.MISS]
        proc.submit_store(Job(3, JobKind.STORE, (random_key(),), (0,)))
        assert [r.success for r in proc.get_finished_jobs()] == [False]
        wait_until(lambda: up(proc), "the killed tier restarted")
        assert proc.pid != first_pid and proc.restarts == 1
        assert settle_lookup(proc, [random_key()]) == [LookupResult.MISS]
    finally:
        proc.shutdown()


def test_hung_tier_is_marked_down_after_the_job_timeout(region: HostRegion, ctx: TierContext) -> None:
    clock = StoppedClock()
    proc = make_proc(region, "memory", job_timeout_s=0.5, restart_backoff_s=60, clock=clock)
    proc.start()
    try:
        pid = proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        fill_slot(ctx, 0)
        proc.submit_store(Job(1, JobKind.STORE, (random_key(),), (0,)))
        clock.advance(0.5)  # unanswered for exactly the job timeout: not hung yet
        assert proc.get_finished_jobs() == [] and proc.is_up and proc.last_failure is None
        clock.advance(0.125)
        [result] = wait_jobs(proc, 1)  # reported once the killed process is gone
        assert not result.success
        assert not proc.is_up
        assert proc.last_failure is not None and proc.last_failure[0] == "hung"
        wait_until(lambda: gone(pid), "the hung process killed and reaped")
    finally:
        proc.shutdown()


def test_backoff_doubles_on_repeated_failures(region: HostRegion) -> None:
    clock = StoppedClock()
    proc = make_proc(region, "memory", restart_backoff_s=1.0, clock=clock)
    proc.start()
    try:
        for n, backoff in enumerate([1.0, 2.0, 4.0], start=1):
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            wait_until(lambda: down(proc), "the killed tier marked down")
            clock.advance(backoff - 0.125)
            assert down(proc), f"restart #{n} came before its back-off of {backoff} s"
            clock.advance(0.125)
            proc.poll()
            assert proc.pid is not None and proc.restarts == n
            wait_until(lambda: up(proc), f"restart #{n} came up")
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
    # The proxy's clock stands still: a cached RETRY would never expire, and no HIT would come.
    proc = make_proc(region, "RetryOnceTier", PLUGIN, clock=StoppedClock())
    proc.start()
    try:
        key = random_key()
        wait_until(lambda: proc.lookup([key]) == [LookupResult.HIT],
                   "a tier's RETRY asked again (it must not stick in the proxy's cache)")
    finally:
        proc.shutdown()


def test_a_lookup_waits_once_for_a_stopped_tier(region: HostRegion) -> None:
    clock = StoppedClock()
    proc = make_proc(region, "memory", clock=clock)
    proc.start()
    try:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGSTOP)  # a tier that cannot answer in time
        try:
            stale = random_key()
            assert proc.lookup([stale]) == [LookupResult.RETRY]
            clock.advance(60.0)
            # A question older than the wait already had its wait: the call returns while the
            # tier is still stopped, unanswered.
            returned = in_thread(lambda: proc.await_answers(30.0))
            wait_until(returned.is_set, "a wait on a stale question returned")
            assert proc.lookup([stale]) == [LookupResult.RETRY]
            # A fresh question gets its wait: the call returns with the answer, once there is one.
            fresh = random_key()
            assert proc.lookup([fresh]) == [LookupResult.RETRY]
            returned = in_thread(lambda: proc.await_answers(60.0))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        wait_until(returned.is_set, "a wait on a fresh question returned with its answer")
        assert proc.lookup([fresh]) == [LookupResult.MISS]
        assert settle_lookup(proc, [random_key()]) == [LookupResult.MISS]
    finally:
        proc.shutdown()


class StoppedClock:
    """A clock that moves only when `advance` is called (times exact in binary)."""

    def __init__(self) -> None:
        self.now = 1024.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def up(proc: TierProcess) -> bool:
    proc.poll()
    return proc.is_up


def down(proc: TierProcess) -> bool:
    """Whether the proxy found its process gone (it is not started again meanwhile)."""
    proc.poll()
    return proc.pid is None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def in_thread(call: Callable[[], object]) -> threading.Event:
    """Run `call` on a daemon thread; the event is set once it returned."""
    returned = threading.Event()

    def run() -> None:
        call()
        returned.set()

    threading.Thread(target=run, daemon=True).start()
    return returned


def test_a_killed_process_that_lingers_holds_its_jobs_until_it_exits(
    region: HostRegion, ctx: TierContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung process stuck in uninterruptible I/O outlives SIGKILL and may still write the rows of
    its loads: its jobs are reported failed (their rows handed on) only once it has exited. No
    process can be put in that state on purpose here: its exit is held back by a stand-in `poll`."""
    clock = StoppedClock()
    proc = make_proc(region, "memory", job_timeout_s=0.5, restart_backoff_s=60, clock=clock)
    proc.start()
    try:
        pid = proc.pid
        assert pid is not None and proc._gen is not None
        lingering = proc._gen.proc
        exited = False
        real_poll = lingering.poll
        monkeypatch.setattr(lingering, "poll", lambda: real_poll() if exited else None)
        os.kill(pid, signal.SIGSTOP)
        proc.submit_load(Job(1, JobKind.LOAD, (random_key(),), (0,)))
        clock.advance(0.625)
        assert proc.get_finished_jobs() == [] and not proc.is_up  # marked down, killed
        wait_until(lambda: gone(pid), "the process killed")
        clock.advance(30.0)
        assert proc.get_finished_jobs() == []  # still held: its exit is not seen yet
        exited = True
        [result] = wait_jobs(proc, 1)
        assert result.job_id == 1 and not result.success
    finally:
        proc.shutdown()


def test_a_flush_sends_the_events_before_the_results_of_the_jobs_that_raised_them(
    ctx: TierContext,
) -> None:
    """A REMOVED raised by a load (a bad chunk) must reach the engine no later than the load's
    result: a reader that sees a result has every event raised before it."""
    tier = MemoryTier(ctx)
    key = random_key()
    tier.submit_store(Job(1, JobKind.STORE, (key,), (0,)))
    engine, runner = socket.socketpair()
    with engine, runner:
        _flush(runner, tier, {})
        first, second = read_message(engine), read_message(engine)
    assert isinstance(first, EventsReport) and [e.keys for e in first.events] == [(key,)]
    assert isinstance(second, JobsDone) and [r.job_id for r in second.results] == [1]


def test_a_jobs_seconds_run_from_its_read_to_its_result_whatever_the_tier_says(
    ctx: TierContext,
) -> None:
    """The load choice prices a tier's loads by the seconds the runner stamps: a tier that reports
    less than the job took (here 0, the memory tier's store is instant) must not make it look
    fast, nor the engine's late poll make it look slow."""
    tier = MemoryTier(ctx)
    tier.submit_store(Job(7, JobKind.STORE, (random_key(),), (0,)))
    engine, runner = socket.socketpair()
    with engine, runner:
        _flush(runner, tier, {7: time.monotonic() - 5.0})
        read_message(engine)
        done = read_message(engine)
    assert isinstance(done, JobsDone)
    [result] = done.results
    assert 5.0 <= result.seconds < 60.0


def test_a_plug_in_tiers_late_results_are_timed_end_to_end(region: HostRegion, ctx: TierContext) -> None:
    """Through a real tier process whose tier holds each job 0.2 s: the result the engine reads
    says at least that, whatever the tier's own clock said."""
    proc = make_proc(region, "DelayedMemoryTier", PLUGIN, options={"delay_s": 0.2})
    proc.start()
    try:
        fill_slot(ctx, 0)
        proc.submit_store(Job(1, JobKind.STORE, (random_key(),), (0,)))
        [result] = wait_jobs(proc, 1)
        assert result.success and result.seconds >= 0.2
    finally:
        proc.shutdown()
