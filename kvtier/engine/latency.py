"""Each request's time to first token and inter-token latency, from what the engine shows the
connector.

The scheduler half holds the engine's requests (`kvtier.engine.request.Request`); once per engine
step (vLLM: `build_connector_meta`, right after the previous step's tokens were appended)
`observe` looks at each one's output-token count: the first time it is above 0 gives TTFT (now
minus the request's `arrival_time`, both wall clock); every later increase by `n` tokens since the
last look gives an inter-token latency of (time since that look) / `n`. `finished` does the same
one last time when the engine finishes the request (its last tokens are appended by then) and
forgets it.

The resolution is one engine step, which is also when a client sees tokens. Samples go to the SLO
guard (`kvtier.ops.guard`), which is checked on the same call. Scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.engine.request import Request
from kvtier.ops.guard import SLOGuard


@dataclass
class _Seen:
    tokens: int
    at: float


class LatencyTracker:
    """Turns per-step looks at requests into TTFT and ITL samples for the guard."""

    def __init__(self, guard: SLOGuard, clock: Callable[[], float] = time.time) -> None:
        self.guard = guard
        self.clock = clock
        self._seen: dict[str, _Seen] = {}

    def observe(self, requests: Iterable[Request]) -> None:
        """One look at every live request, then the guard's check. Called once per step."""
        now = self.clock()
        for request in requests:
            self._look(request, now)
        self.guard.check()

    def finished(self, request: Request) -> None:
        """The last look at a request vLLM finished or aborted."""
        self._look(request, self.clock())
        self._seen.pop(request.request_id, None)

    def _look(self, request: Request, now: float) -> None:
        tokens = request.num_output_tokens
        if tokens <= 0:
            return
        seen = self._seen.get(request.request_id)
        if seen is None:
            self.guard.observe_ttft(max(now - request.arrival_time, 0.0))
            self._seen[request.request_id] = _Seen(tokens, now)
            return
        if tokens > seen.tokens:
            self.guard.observe_itl((now - seen.at) / (tokens - seen.tokens))
            seen.tokens, seen.at = tokens, now
