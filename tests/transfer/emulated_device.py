"""An emulated accelerator for the stream transfer's tests: streams and events over CPU tensors.

`EmulatedDevice` is a `CopyStreams` whose streams are queues of work that run later, when the test
advances the device, in each stream's order, as a GPU runs what the host queued on it:

- the compute stream holds the test's "forward passes" (`compute(fn)`), the events `mark_compute`
  records, and the waits `compute_waits` queues;
- the store and load streams hold, per launched job, its waits (`after`), its start event, its
  copies (the `enqueue` callable, run only when the stream reaches it: copies read and write the
  tensors then, not when they were queued) and its end event.

An event completes when its stream reaches it; a stream blocked on an event not completed stays
where it is. `run(schedule)` advances the streams until none can move, taking at each step the
first stream of the schedule that can move (or a random one, for a seeded schedule), so one test
can run the copies as early, or as late, as the ordering allows: a missing wait shows as bytes
read before they were written, or overwritten before they were read. `synchronize` is counted and
runs the device until its event completed (a deadlock raises); `seconds` refuses an event not
completed.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.transfer.stream import CopyEvent, CopyStreams, Direction

COMPUTE = "compute"
STORE = Direction.STORE.value
LOAD = Direction.LOAD.value
COPIES_FIRST = (STORE, LOAD, COMPUTE)
"""Run the copies as early as their waits allow: a copy that does not wait reads too soon."""
COMPUTE_FIRST = (COMPUTE, LOAD, STORE)
"""Run the forward passes as early as their waits allow: a pass that does not wait overwrites."""
LOADS_FIRST = (LOAD, COMPUTE, STORE)
"""Run loads first: a load that does not wait for a running store overwrites what it reads."""


@dataclass
class EmulatedEvent:
    """A marker on one stream; `done` once the stream reached it."""

    device: EmulatedDevice
    name: str
    done: bool = False
    tick: int = 0
    syncs: int = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.device.run(until=lambda: self.done)
        if not self.done:
            raise RuntimeError(f"deadlock: {self.name} can never complete")


@dataclass
class _Op:
    kind: str  # "wait", "record" or "run"
    event: EmulatedEvent | None = None
    fn: Callable[[], None] | None = None


@dataclass
class EmulatedDevice(CopyStreams):
    """Three streams (compute, store, load) of deferred work over CPU tensors."""

    queues: dict[str, deque[_Op]] = field(
        default_factory=lambda: {COMPUTE: deque(), STORE: deque(), LOAD: deque()}
    )
    events: list[EmulatedEvent] = field(default_factory=list)
    clock: int = 0

    def event(self, name: str) -> EmulatedEvent:
        made = EmulatedEvent(self, f"{name}#{len(self.events)}")
        self.events.append(made)
        return made

    def compute(self, fn: Callable[[], None]) -> None:
        """Queue `fn` (a forward pass: it reads and writes engine tensors) on the compute stream."""
        self.queues[COMPUTE].append(_Op("run", fn=fn))

    def mark_compute(self) -> CopyEvent:
        marked = self.event("forward")
        self.queues[COMPUTE].append(_Op("record", marked))
        return marked

    def launch(
        self, direction: Direction, after: Sequence[CopyEvent], enqueue: Callable[[], None]
    ) -> tuple[CopyEvent, CopyEvent]:
        queue = self.queues[direction.value]
        for waited in after:
            assert isinstance(waited, EmulatedEvent)
            queue.append(_Op("wait", waited))
        start, end = self.event(f"{direction.value}-start"), self.event(f"{direction.value}-end")
        queue.extend([_Op("record", start), _Op("run", fn=enqueue), _Op("record", end)])
        return start, end

    def compute_waits(self, event: CopyEvent) -> None:
        assert isinstance(event, EmulatedEvent)
        self.queues[COMPUTE].append(_Op("wait", event))

    def seconds(self, start: CopyEvent, end: CopyEvent) -> float:
        assert isinstance(start, EmulatedEvent) and isinstance(end, EmulatedEvent)
        assert start.done and end.done, "elapsed time asked of an event not completed"
        return (end.tick - start.tick) / 1000.0

    def _step(self, stream: str) -> bool:
        """Run the head of `stream`'s queue; False when it is empty or waits on an event."""
        queue = self.queues[stream]
        if not queue:
            return False
        op = queue[0]
        if op.kind == "wait":
            assert op.event is not None
            if not op.event.done:
                return False
        elif op.kind == "record":
            assert op.event is not None
            self.clock += 1
            op.event.done, op.event.tick = True, self.clock
        else:
            assert op.fn is not None
            op.fn()
        queue.popleft()
        return True

    def run(
        self,
        schedule: Sequence[str] | int = COPIES_FIRST,
        until: Callable[[], bool] = lambda: False,
    ) -> None:
        """Advance the streams until none can move (or `until()` holds): each step runs the first
        stream of `schedule` that can move, or, for an int schedule, a random one (seeded by it)."""
        rng = random.Random(schedule) if isinstance(schedule, int) else None
        order = list(self.queues) if rng else list(schedule)
        while not until():
            if rng is not None:
                rng.shuffle(order)
            if not any(self._step(stream) for stream in order):
                return

    def run_stream(self, stream: str) -> None:
        """Advance one stream alone as far as it can go."""
        while self._step(stream):
            pass

    @property
    def idle(self) -> bool:
        return not any(self.queues.values())

    @property
    def syncs(self) -> int:
        return sum(e.syncs for e in self.events)
