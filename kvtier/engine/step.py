"""What the scheduler side and the workers tell each other every engine step.

Scheduler → workers (`StepPlan`, built on the scheduler thread by `Planner.step`, handed to each
worker before the forward pass): the host region's name, and the chunk copies to run this step. It
holds plain ints and strings only, so an engine may ship it to worker processes; a worker needs
nothing else from the scheduler process (it attaches the region by name).

Workers → scheduler (`CopyReport`, built after the step by `CopyDriver.take_report`, merged over
all workers, handed to `Planner.copies_done`): which store and load jobs each worker finished,
whether each copy succeeded and how long it took. The engine also names the requests whose
asynchronous loads ended (vLLM: `finished_recving`), which releases their pins; a synchronous
load's pins are released when every worker reported it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.copies import ChunkCopy, StateCopy


@dataclass
class StepPlan:
    """This step's work for the workers.

    `loads` run before the step's requests need them (host → device, for requests waiting for
    their KV); `stores` run after the forward pass computed the blocks (device → host). State
    copies (models with recurrent layers) run with them, before a request's chunk loads and after
    the forward pass. `releases` are finished requests whose blocks the engine kept for kvtier's
    stores (`kvtier.engine.tails`): each is reported finished sending once every store planned
    for it, up to this step's, has ended.
    """

    region_name: str
    shm_dir: str
    loads: tuple[ChunkCopy, ...] = ()
    stores: tuple[ChunkCopy, ...] = ()
    state_loads: tuple[StateCopy, ...] = ()
    state_stores: tuple[StateCopy, ...] = ()
    releases: tuple[str, ...] = ()


Acks = dict[int, tuple[int, bool]]
"""Job id → (how many workers finished it, all of them succeeded)."""


@dataclass
class CopyReport:
    """Copy jobs finished by workers: `stores` and `loads` as `Acks`, and job id → the slowest
    worker's copy time in seconds."""

    stores: Acks = field(default_factory=dict)
    loads: Acks = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def merged(self, other: CopyReport) -> CopyReport:
        """This report and another worker's: counts add up, one failure fails the job, the longest
        time is kept."""
        seconds = dict(self.seconds)
        for job_id, secs in other.seconds.items():
            seconds[job_id] = max(secs, seconds.get(job_id, 0.0))
        return CopyReport(_merge(self.stores, other.stores), _merge(self.loads, other.loads), seconds)


def _merge(mine: Acks, theirs: Acks) -> Acks:
    merged = dict(mine)
    for job_id, (count, ok) in theirs.items():
        have_count, have_ok = merged.get(job_id, (0, True))
        merged[job_id] = (have_count + count, have_ok and ok)
    return merged
