"""The engine-side proxy of a tier running in its own process.

`TierProcess` exposes the tier contract's four methods to the scheduler thread and never blocks it:
requests go out through a sender thread's queue and replies come back through a receiver thread's
queue (`TierChannel`), as the typed frames of `kvtier.tiers.messages`. Lookups are asynchronous: a
key not answered yet is RETRY and is asked in one batch; answers are remembered for `lookup_ttl_s`.

Counting: the tier's own counts (`SecondaryTier.counts`) come in the process's stats reports and
go straight into kvtier's metrics (`KVTierMetrics.count_tier`), the manager's when the manager
built the process; each generation of the process counts from zero, the metrics over all of them.

Liveness: a process that exits, sends a malformed frame or an `ErrorReport`, or leaves a job or
lookup unanswered for `job_timeout_s`, is marked down (`last_failure` keeps the latest cause, as
does a failed job). Its in-flight jobs finish as failures, lookups answer MISS and new jobs fail at
once, so serving goes on without it. It is started again after a back-off that doubles on each
consecutive failure (capped at `MAX_BACKOFF_S`) and resets once a restarted process has completed a
job.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError, KVTierError
from kvtier.format.chunks import ChunkKey, TierEvent
from kvtier.ops.metrics import KVTierMetrics, TierCounts
from kvtier.tiers.base import Job, JobKind, JobResult, LookupResult, TierUsage
from kvtier.tiers.channel import Inbound, Inbox, TierChannel
from kvtier.tiers.codec import MessageError
from kvtier.tiers.common.answers import AnswerCache
from kvtier.tiers.killed import KilledProcesses
from kvtier.tiers.messages import (
    ErrorReport,
    EventsReport,
    JobRequest,
    JobsDone,
    LookupReply,
    LookupRequest,
    Message,
    Ready,
    Shutdown,
    StatsReport,
    StatsRequest,
)

MAX_BACKOFF_S = 30.0
FAILURE_CAUSES = ("exited", "hung", "error", "store_failed", "load_failed")
"""Why a tier last failed: its process exited, left a job or lookup unanswered (hung), reported
an error or sent a malformed frame, or a store or load job of a live process failed."""
STARTUP_TIMEOUT_S = 60.0
log = logging.getLogger("kvtier.tiers")


class TierStartError(KVTierError):
    """A tier process did not come up."""


@dataclass(frozen=True)
class TierSpec:
    """Everything a tier process needs to build its tier (sent as JSON on its stdin)."""

    tier_name: str
    type: str
    module_path: str | None
    options: dict[str, Any]
    config_key: str
    region_name: str
    shm_dir: str
    row_bytes: int
    num_slots: int
    layout_fingerprint: str
    generations_offset: int | None = None  # where the slot generations start (`host.generations`)
    fleet_key_file: str | None = None
    """The fleet key's file, which the tier process reads (the key itself never leaves it)."""


class TierProcess:
    """Scheduler-side handle of one tier process. All methods are for one (scheduler) thread."""

    def __init__(
        self,
        spec: TierSpec,
        *,
        job_timeout_s: float = 60.0,
        restart_backoff_s: float = 1.0,
        lookup_ttl_s: float = 2.0,
        metrics: KVTierMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.clock = clock
        """What job and lookup ages, answer lifetimes and restart back-offs are measured by (startup
        and the bounded waits block in real time)."""
        self.name = spec.tier_name
        self.metrics = KVTierMetrics() if metrics is None else metrics
        """Where the tier's own counts go (`tier_counter`, `bad_chunks`, `tier_gauge`)."""
        self.job_timeout_s = job_timeout_s
        self.lookup_ttl_s = lookup_ttl_s
        self._base_backoff = restart_backoff_s
        self._backoff = restart_backoff_s
        self._inbox: Inbox = queue.SimpleQueue()
        self._gen: TierChannel | None = None
        self._gen_id = 0
        self._restart_at: float | None = None
        self._jobs: dict[int, tuple[Job, float]] = {}
        self._killed = KilledProcesses(self.name)
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []
        self._answers = AnswerCache(lookup_ttl_s)
        self._asked: dict[int, tuple[tuple[ChunkKey, ...], float]] = {}
        self._next_req = 0
        self.last_usage: TierUsage | None = None
        """How full the tier is (`SecondaryTier.usage`), as of the last report; None: not reported."""
        self.stats_version = 0
        """Counts the stats reports received (each already in `metrics`); `request_stats` makes the
        next one come at once."""
        self.endpoints: dict[str, str] = {}
        """Where other processes reach the tier (`SecondaryTier.endpoints`), once it is up."""
        self.restarts = 0
        self._counted = TierCounts()
        """This generation's counts as of its last report (what `metrics` already has of it)."""
        self.last_failure: tuple[str, float] | None = None
        """The cause (`FAILURE_CAUSES`) and Unix time of the tier's latest failure; None: none yet."""
        self._closed = False
        self._stores_prove_hits = True

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start the process and wait until its tier is built (startup only, never per step)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process without waiting (several tiers then come up in parallel)."""
        self._spawn()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the launched tier is built.

        Raises ConfigError with the tier's own message when it rejects its options, and
        TierStartError when the process dies or does not answer within `timeout_s`; the process is
        shut down in both cases."""
        deadline = time.monotonic() + timeout_s
        while self._gen is not None and not self._gen.ready:
            if time.monotonic() > deadline:
                self.shutdown()
                raise TierStartError(f"tier {self.name!r} did not start within {timeout_s} s")
            try:
                gen_id, msg = self._inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if msg is None or isinstance(msg, ErrorReport | MessageError):
                detail = ("process exited" if msg is None else
                          msg.message if isinstance(msg, ErrorReport) else f"malformed message: {msg}")
                self.shutdown()
                if isinstance(msg, ErrorReport) and msg.key is not None:
                    raise ConfigError(f"{self.spec.config_key}.{msg.key}", msg.value, msg.allowed)
                raise TierStartError(f"tier {self.name!r} failed to start: {detail}")
            self._handle(gen_id, msg)

    def _spawn(self) -> None:
        spec = dict(self.spec.__dict__, log_level=logging.getLogger("kvtier").getEffectiveLevel())
        self._gen_id += 1
        self._counted = TierCounts()
        self._gen = TierChannel(self.name, spec, self._gen_id, self._inbox)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the process (politely, then SIGKILL after `timeout_s`). Idempotent."""
        self._closed = True
        gen, self._gen = self._gen, None
        self._bury(everything=True)
        if gen is None:
            return
        gen.send(Shutdown())
        try:
            gen.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            gen.proc.kill()
            gen.proc.wait()
        gen.close()
        self._fail_in_flight()

    @property
    def is_up(self) -> bool:
        return self._gen is not None and self._gen.ready

    @property
    def pid(self) -> int | None:
        return None if self._gen is None else self._gen.proc.pid

    # -- the tier contract ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> list[LookupResult]:
        """Known answers, RETRY for keys being asked; MISS for everything while the tier is down."""
        self.poll()
        if not self.is_up:
            return [LookupResult.MISS] * len(keys)
        now = self.clock()
        out, ask = self._answers.lookup(keys, now)
        if ask:
            self._next_req += 1
            self._asked[self._next_req] = (tuple(ask), now)
            self._send(LookupRequest(self._next_req, tuple(ask)))
        return out

    def await_answers(self, timeout_s: float) -> None:
        """Block up to `timeout_s` until every lookup asked in the last `timeout_s` is answered (or
        the tier is down), handling the replies that arrive meanwhile; the next `lookup` then has
        the answers.

        A bounded wait on the scheduler thread: a new prompt's first lookup costs one round trip
        to the tier process instead of a whole engine step of "ask again". A question older than
        `timeout_s` already had its wait: a slow tier costs each question one wait, not one per
        engine step until it answers.
        """
        start = self.clock()
        self._await(lambda: any(start - asked < timeout_s for _, asked in self._asked.values()),
                    timeout_s)

    def await_jobs(self, job_ids: Collection[int], timeout_s: float) -> None:
        """Block up to `timeout_s` until none of `job_ids` is in flight (or the tier is down),
        handling the replies that arrive meanwhile; the next `get_finished_jobs` has them."""
        self._await(lambda: any(j in self._jobs for j in job_ids), timeout_s)

    def _await(self, waiting: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.is_up and waiting():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                gen_id, msg = self._inbox.get(timeout=left)
            except queue.Empty:
                return
            self._handle(gen_id, msg)

    def submit_store(self, job: Job) -> None:
        self._submit(job)

    def submit_load(self, job: Job) -> None:
        self._submit(job)

    def get_finished_jobs(self) -> list[JobResult]:
        """Drain replies, detect a dead or hung process, restart one that is due."""
        self.poll()
        finished, self._finished = self._finished, []
        return finished

    def request_stats(self) -> None:
        """Ask for a stats report now (it arrives after every job finished before the request)."""
        self._send(StatsRequest())

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    # -- internals -----------------------------------------------------------------------------

    def _submit(self, job: Job) -> None:
        if not self.is_up:
            self._finished.append(JobResult(job.job_id, success=False))
            return
        self._jobs[job.job_id] = (job, self.clock())
        self._send(JobRequest(job))

    def _send(self, msg: Message) -> None:
        if self._gen is not None:
            self._gen.send(msg)

    def poll(self) -> None:
        """Process every reply received so far; never blocks."""
        while True:
            try:
                gen_id, msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._handle(gen_id, msg)
        self._bury()
        now = self.clock()
        if self._gen is not None and self._gen.ready:
            oldest = min((t for _, t in self._jobs.values()), default=now)
            oldest = min((t for _, t in self._asked.values()), default=oldest)
            if now - oldest > self.job_timeout_s:
                self._mark_down("hung", f"no answer for {now - oldest:.1f} s")
        elif self._gen is None and self._restart_at is not None and now >= self._restart_at:
            self._restart_at = None
            self.restarts += 1
            log.info("restarting tier %s (restart #%d)", self.name, self.restarts)
            self._spawn()

    def _handle(self, gen_id: int, msg: Inbound) -> None:
        if self._gen is None or gen_id != self._gen.gen_id:
            return
        if msg is None:
            self._mark_down("exited", f"process exited (code {self._gen.proc.poll()})")
        elif isinstance(msg, MessageError):
            self._mark_down("error", f"malformed message: {msg}")
        elif isinstance(msg, Ready):
            self._gen.ready = True
            self._stores_prove_hits = msg.loads_own_stores
            self.endpoints = dict(msg.endpoints)
        elif isinstance(msg, JobsDone):
            self._done(msg.results)
        elif isinstance(msg, LookupReply):
            self._answered(msg)
        elif isinstance(msg, EventsReport):
            self._events.extend(msg.events)
        elif isinstance(msg, StatsReport):
            self.metrics.count_tier(self.name, msg.counts, self._counted)
            self._counted = msg.counts
            self.last_usage = msg.usage
            self.stats_version += 1
        elif isinstance(msg, ErrorReport):
            self._mark_down("error", msg.message)
        else:
            self._mark_down("error", f"the tier sent the engine's message {type(msg).__name__}")

    def _done(self, results: Sequence[JobResult]) -> None:
        for result in results:
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                continue
            self._backoff = self._base_backoff
            # What a job proved about its keys is a fresh lookup answer.
            now = self.clock()
            if entry[0].kind is JobKind.LOAD or self._stores_prove_hits:
                for key in result.successful_keys:
                    self._answers.put(key, LookupResult.HIT, now)
            if entry[0].kind is JobKind.LOAD:
                for key in set(entry[0].keys).difference(result.successful_keys):
                    self._answers.put(key, LookupResult.MISS, now)
            if not result.success:
                self._failed(f"{entry[0].kind.value}_failed")
            self._finished.append(result)

    def _answered(self, reply: LookupReply) -> None:
        asked = self._asked.pop(reply.req_id, None)
        if asked is None:
            return
        if len(asked[0]) != len(reply.results):
            self._mark_down("error", f"{len(reply.results)} answers to {len(asked[0])} keys")
            return
        now = self.clock()
        for key, result in zip(asked[0], reply.results, strict=True):
            self._answers.unask(key)
            # RETRY is not an answer: the next lookup asks the tier again.
            if result != LookupResult.RETRY:
                self._answers.put(key, result, now)

    def _failed(self, cause: str) -> None:
        self.last_failure = (cause, time.time())

    def _mark_down(self, cause: str, why: str) -> None:
        gen, self._gen = self._gen, None
        if gen is None:
            return
        if not self._closed:
            self._failed(cause)
        with contextlib.suppress(ProcessLookupError):
            gen.proc.kill()
        gen.close()
        threading.Thread(target=gen.proc.wait, daemon=True).start()
        self._killed.add(gen.proc, list(self._jobs), self.clock())  # failed once it is gone
        self._jobs.clear()
        self._fail_in_flight()
        if self._closed:
            return
        self._restart_at = self.clock() + self._backoff
        log.warning("tier %s is down: %s; restarting in %.1f s", self.name, why, self._backoff)
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _bury(self, everything: bool = False) -> None:
        """Fail the jobs of the killed processes that have exited (`KilledProcesses`)."""
        ended = self._killed.ended(self.clock(), everything)
        self._finished.extend(JobResult(job_id, success=False) for job_id in ended)

    def _fail_in_flight(self) -> None:
        for job_id in self._jobs:
            self._finished.append(JobResult(job_id, success=False))
        self._jobs.clear()
        self._asked.clear()
        self._answers.reset()
