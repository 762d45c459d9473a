"""What an operator gets from a running engine's scheduler half: the SLO guard fed with each
request's latencies, the control socket `kvtier ctl` talks to, and the signals the guard and a
dashboard need (promotion waits by source tier, tier health, the configuration as a metric, every
series known at start at zero).

Built once by the scheduler half after its tiering manager, on the scheduler thread; `step` runs
every engine step (latency looks, the guard's rule, queued tier switches), `finished` when vLLM
finishes a request, `shutdown` (idempotent) closes the socket. A control socket that cannot be
made (a directory that is not private) fails the engine start with a ConfigError.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvtier.config import KVTierConfig
from kvtier.engine.latency import LatencyTracker
from kvtier.engine.request import Request
from kvtier.format.chunks import HOST
from kvtier.manager import TieringManager
from kvtier.ops.control_server import ControlServer, engine_control_dir
from kvtier.ops.guard import SLOGuard
from kvtier.policies.base import AdmitAll


class Operations:
    """The SLO guard, its latency tracker and the control socket of one engine."""

    def __init__(self, config: KVTierConfig, manager: TieringManager) -> None:
        self.manager = manager
        self.guard = None if config.slo_guard is None else SLOGuard(
            config.slo_guard, manager, manager.metrics
        )
        self.latency = None if self.guard is None else LatencyTracker(self.guard)
        directory = engine_control_dir(config.control_dir)
        self._waiting: dict[str, float] = {}
        """Requests whose lookup answered "ask again", since when (monotonic)."""
        reasons = [p.name for p in manager.admission.policies if p.name != AdmitAll.name]
        manager.metrics.declare(list(manager.tiers), reasons)
        tiers = ",".join(f"{t.name}:{t.type}" for t in config.secondary_tiers)
        manager.metrics.set(
            "config_info", 1.0, config.eviction_policy, ",".join(config.admission_policy), tiers,
            str(config.cpu_bytes_to_use), str(config.blocks_per_chunk),
        )
        self.control = ControlServer(
            directory, manager.tier_names(), manager.metrics,
            None if self.guard is None else self.guard.state,
        )

    def step(self, requests: Iterable[Request]) -> None:
        """Once per engine step: apply queued switches, look at live requests, check the guard."""
        self.control.apply_pending(self._switch)
        self._health()
        if self.latency is not None:
            self.latency.observe(requests)

    def finished(self, request: Request) -> None:
        self._waiting.pop(request.request_id, None)
        if self.latency is not None:
            self.latency.finished(request)

    def lookup_answered(self, req_id: str, pending: bool, sources: Iterable[str]) -> None:
        """A lookup for `req_id` answered "ask again" (`pending`) or for good: the first time since
        an "ask again", the wait is observed once per tier its promotion came from."""
        now = time.monotonic()
        if pending:
            self._waiting.setdefault(req_id, now)
            return
        since = self._waiting.pop(req_id, None)
        if since is not None:
            for tier in set(sources) - {HOST}:
                self.manager.metrics.observe("promotion_wait_seconds", now - since, tier)

    def _health(self) -> None:
        """Tier health and host saturation, once per step."""
        m = self.manager.metrics
        for name, tier in self.manager.tiers.items():
            m.set("tier_up", 1.0 if tier.is_up else 0.0, name)
            m.set("tier_restarts", float(tier.restarts), name)
            failure = tier.last_failure
            if failure is not None:
                m.set("tier_last_failure", failure[1], name, failure[0])
        for name, jobs in self.manager.jobs_in_flight().items():
            m.set("jobs_in_flight", float(jobs), name)
        m.set("host_pinned_chunks", float(self.manager.host_stats().pinned))

    def _switch(self, tier: str, enabled: bool) -> None:
        """An operator's switch: applied, and no longer the guard's to undo."""
        self.manager.set_enabled(tier, enabled)
        if self.guard is not None:
            self.guard.forget(tier)

    def shutdown(self) -> None:
        self.control.close()
