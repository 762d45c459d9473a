"""The connector's request trace (`trace_path`): one record per finished request, in the format of
`kvtier.trace.records`, handed to the background `TraceWriter` (never blocking the scheduler).

The scheduler half calls a `RequestTracer` on its scheduler thread at four points: each lookup
(`looked_up`: a lookup answered "ask again" while a promotion is in flight, so the promotion wait
runs from the first such answer to the next answer), each step (`step`, then `scheduled` for every
scheduled request), and `finished`. The first token is taken to exist at the start of the step
after the one that computed the last prompt token (its forward pass is over then), or at finish if
that comes first; TTFT runs from the request's arrival to that time. `lookup` is when the last
answered lookup (the one the request's blocks were allocated on) came, after arrival. `st` lists
the steps that completed chunks of the request: (seconds after arrival, chunks complete after the
step), taken when the step is scheduled, which is when the host tier reserves rows for those
chunks (`build_connector_meta`, after that step's lookups). Without `trace_path` the scheduler
holds a `NoTracer`, whose hooks do nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.config import KVTierConfig
from kvtier.engine.geometry import EngineGeometry
from kvtier.trace.records import TraceHeader, encode_keys
from kvtier.trace.writer import TraceWriter

if TYPE_CHECKING:
    from kvtier.engine.request import Request


class NoTracer:
    """Tracing off: every hook is a no-op."""

    def looked_up(self, req_id: str, pending: bool) -> None:
        """A lookup for `req_id` answered; `pending`: it must ask again (promotion in flight)."""

    def step(self) -> None:
        """A scheduler step starts (the previous step's forward pass is over)."""

    def scheduled(self, req_id: str, computed: int, prompt_tokens: int) -> None:
        """`req_id` will have `computed` tokens computed at the end of this step."""

    def finished(self, request: Request, keys: Sequence[bytes], split: Mapping[str, int],
                 priority: int) -> None:
        """`request` finished; `keys` its chunk keys so far, `split` its prompt tokens by source."""

    def close(self) -> None:
        """Write what is queued and stop. Idempotent."""


@dataclass
class _Times:
    lookup: float | None = None
    wait_since: float | None = None
    wait_s: float = 0.0
    prefilled: bool = False
    first_token: float | None = None
    chunks: int = 0
    stores: list[tuple[float, int]] = field(default_factory=list)


class RequestTracer(NoTracer):
    """Builds each finished request's record and queues it to the writer."""

    def __init__(self, writer: TraceWriter, chunk_tokens: int) -> None:
        self.writer = writer
        self.chunk_tokens = chunk_tokens
        self._times: dict[str, _Times] = {}
        self._prefilled: list[_Times] = []
        self._salt_key = secrets.token_bytes(32)
        """Keys the `salt` field: random per trace and never written, so a tenant's requests
        group within the trace while a reader can neither test a guessed `cache_salt` against it
        nor link a tenant across traces."""

    @classmethod
    def make(cls, config: KVTierConfig, geometry: EngineGeometry) -> NoTracer:
        """A tracer writing to `config.trace_path`, or a `NoTracer` when it is not set."""
        if config.trace_path is None:
            return NoTracer()
        header = TraceHeader("connector", geometry.block_size, geometry.blocks_per_chunk,
                             geometry.layout.row_bytes)
        return cls(TraceWriter(config.trace_path, header, config.trace_max_bytes), geometry.chunk_tokens)

    def _of(self, req_id: str) -> _Times:
        times = self._times.get(req_id)
        if times is None:
            times = self._times[req_id] = _Times()
        return times

    def looked_up(self, req_id: str, pending: bool) -> None:
        times = self._of(req_id)
        now = time.time()
        if pending and times.wait_since is None:
            times.wait_since = now
        elif not pending:
            times.lookup = now
            if times.wait_since is not None:
                times.wait_s += now - times.wait_since
                times.wait_since = None

    def step(self) -> None:
        if self._prefilled:
            now = time.time()
            for times in self._prefilled:
                times.first_token = now
            self._prefilled = []

    def scheduled(self, req_id: str, computed: int, prompt_tokens: int) -> None:
        times = self._of(req_id)
        chunks = computed // self.chunk_tokens
        if chunks > times.chunks:
            times.stores.append((time.time(), chunks))
            times.chunks = chunks
        if computed >= prompt_tokens and not times.prefilled:
            times.prefilled = True
            self._prefilled.append(times)

    def finished(self, request: Request, keys: Sequence[bytes], split: Mapping[str, int],
                 priority: int) -> None:
        times = self._times.pop(request.request_id, None) or _Times()
        now = time.time()
        first = times.first_token or now
        prompt = request.num_prompt_tokens
        salt = request.cache_salt
        self.writer.write({
            "t": request.arrival_time, "end": now, "prompt": prompt,
            "output": request.num_output_tokens,
            "keys": encode_keys(keys[: prompt // self.chunk_tokens]),
            "dkeys": encode_keys(keys[prompt // self.chunk_tokens :]),
            "src": dict(split), "ttft": first - request.arrival_time if times.prefilled else None,
            "wait": times.wait_s, "prio": priority,
            "lookup": None if times.lookup is None else times.lookup - request.arrival_time,
            "st": [[round(at - request.arrival_time, 4), n] for at, n in times.stores],
            "salt": self.salt_tag(salt) if salt else None,
        })

    def salt_tag(self, salt: str) -> str:
        """The trace's tag of a `cache_salt`: 16 hex digits of a hash keyed by this trace's key."""
        return hashlib.blake2b(salt.encode(), key=self._salt_key, digest_size=8).hexdigest()

    def close(self) -> None:
        self.writer.close()
