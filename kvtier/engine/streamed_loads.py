"""Streamed loads: a prefix longer than the host tier has room for, reloaded a batch at a time.

When the secondary tiers hold more of a request's prefix than the host tier can take at once, the
scheduler still offers the whole prefix to vLLM as one asynchronous load, and streams the chunks
that did not fit: promote the leading batch that fits into the host tier, copy it to the device
blocks vLLM allocated for it, release its rows, promote the next. A request has at most one part
of its load in flight, so its parts end in order and the worker reports the request finished
with its `last` part (`ChunkCopy.last`). Without streaming those chunks would be recomputed.

A chunk whose promotion or copy fails ends the stream: the rest of the prefix goes out as a last
part without host rows, which the worker fails, and vLLM recomputes from the first failed block
(kvtier's configs set `kv_load_failure_policy` to "recompute"). A batch that finds no room now
(rows pinned by copies in flight) is tried again on a later step: the parts in flight release
their rows when they end. Rows held for requests vLLM has not scheduled yet are released only when
it does, and it may be waiting for device blocks that streaming requests hold: a stream that finds
no room for `STARVED_S` gives up the rest of its prefix (recomputed), so a burst always ends.

Runs on the scheduler thread, once per step (`parts`) and when a part ends (`part_done`); never
blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.engine.copies import ChunkCopy
from kvtier.manager import TieringManager

STARVED_S = 2.0
"""How long a stream may find no host room for its next batch before it gives up the rest."""


@dataclass
class _Stream:
    """The chunks of one request's load not yet sent to the device, in prefix order."""

    keys: list[bytes]
    sources: list[str]
    block_ids: list[tuple[int, ...]]
    priority: int
    """The request's retention priority, which its promotions get."""
    tenant: int
    """The request's tenant id, which holds the host rows its promotions fill."""
    promoting: int = 0
    """How many leading `keys` are being promoted (0: none)."""
    in_flight: bool = False
    """A part of this request's load is being copied to the device."""
    failed: bool = False
    """A promotion or copy failed: the rest goes out as a failed last part."""
    no_room_since: float | None = None
    """When the stream last found no room for its next batch (None: it found room)."""
    promoted_at: float = 0.0
    """When the promotion of the batch in flight started."""
    patience: float | None = None
    """How long that batch may take (None: whatever it takes)."""


@dataclass(frozen=True)
class Part:
    """A part to send: the copy, and the source tier of each of its chunks."""

    copy: ChunkCopy
    sources: list[str]
    given_up: bool = False
    """The stream stopped waiting for a slow batch (`load_policy: auto`): a failed last part whose
    chunks are recomputed by choice."""


class LoadStreams:
    """The streamed loads of one engine's requests."""

    def __init__(self, manager: TieringManager, job_ids: Iterator[int],
                 patience: Callable[[Sequence[str]], float | None] = lambda sources: None) -> None:
        """`patience(sources)`: how long a batch of chunks from `sources` may take to promote
        (None: whatever it takes); a stream past it gives up the rest of its prefix."""
        self.manager = manager
        self.patience = patience
        self._job_ids = job_ids
        self._streams: dict[str, _Stream] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def start(self, req_id: str, keys: list[bytes], sources: list[str],
              block_ids: list[tuple[int, ...]], priority: int, head_in_flight: bool, tenant: int = 0) -> None:
        """Stream `keys` (from `sources`) into `block_ids` for a request of retention `priority`
        and tenant id `tenant`, after the part already sent for the request's leading chunks when
        `head_in_flight`."""
        self._streams[req_id] = _Stream(keys, sources, block_ids, priority, tenant, in_flight=head_in_flight)

    def part_done(self, req_id: str, ok: bool) -> None:
        """A part that was not the last ended on every worker (`ok`: every copy succeeded)."""
        stream = self._streams.get(req_id)
        if stream is not None:
            stream.in_flight = False
            stream.failed = stream.failed or not ok

    def drop(self, req_id: str) -> None:
        """Stop streaming for a request that finished or was aborted; the holds on the chunks it
        had not sent yet are released (a part in flight still ends and releases its own rows)."""
        stream = self._streams.pop(req_id, None)
        if stream is not None:
            self.manager.release(stream.keys)

    def parts(self) -> list[Part]:
        """The parts ready to send this step; starts the promotions of the next batches."""
        out: list[Part] = []
        for req_id, stream in list(self._streams.items()):
            part = None if stream.in_flight else self._next(req_id, stream)
            if part is None:
                continue
            out.append(part)
            stream.in_flight = True
            if part.copy.last:
                del self._streams[req_id]
        return out

    def _next(self, req_id: str, stream: _Stream) -> Part | None:
        if stream.failed:
            return self._part(req_id, stream, 0, ())
        if not stream.promoting:
            stream.promoting = self.manager.promote(stream.keys, stream.sources, stream.priority,
                                                    stream.tenant)
            if not stream.promoting:
                now = time.monotonic()
                stream.no_room_since = stream.no_room_since or now
                if now - stream.no_room_since < STARVED_S:
                    return None
                return self._part(req_id, stream, 0, ())
            stream.no_room_since = None
            stream.promoted_at = time.monotonic()
            stream.patience = self.patience(stream.sources[: stream.promoting])
        batch = stream.keys[: stream.promoting]
        ready = self.manager.ready_prefix(batch)
        if ready is None:
            if stream.patience is None or time.monotonic() - stream.promoted_at <= stream.patience:
                return None
            return self._part(req_id, stream, 0, (), given_up=True)
        slots = self.manager.pin_rows(batch[:ready]) if ready else None
        self.manager.release(batch)
        stream.promoting = 0
        if slots is None:
            return self._part(req_id, stream, 0, ())
        stream.failed = ready < len(batch)
        return self._part(req_id, stream, ready, tuple(slots))

    def _part(self, req_id: str, stream: _Stream, count: int, slots: tuple[int, ...],
              given_up: bool = False) -> Part:
        """The next `count` chunks as a part; without `slots`, a failed part that takes the rest
        of the prefix with it (and so is the last), releasing their holds (`given_up`: by
        choice)."""
        if not slots:
            count = len(stream.keys)
            self.manager.release(stream.keys)
        keys, stream.keys = stream.keys[:count], stream.keys[count:]
        sources, stream.sources = stream.sources[:count], stream.sources[count:]
        blocks, stream.block_ids = stream.block_ids[:count], stream.block_ids[count:]
        last = not stream.keys
        copy = ChunkCopy(next(self._job_ids), req_id, tuple(keys), tuple(blocks), slots, last)
        return Part(copy, sources, given_up)
