"""What the two halves of the connector tell each other every engine step.

Scheduler → worker (`KVTierMetadata`, built on the scheduler thread by `build_connector_meta`,
bound on each worker before the forward pass): the host region's name, and the chunk copies to run
this step. It holds plain ints and strings only, so vLLM may ship it to worker processes; a worker
needs nothing else from the scheduler process (it attaches the region by name).

Worker → scheduler (`KVTierWorkerMetadata`, built after the step by `build_connector_worker_meta`,
aggregated over all workers by vLLM and handed to `update_connector_output`): which store and load
jobs each worker finished, whether each copy succeeded and how long it took. Finished loads also
travel through vLLM's own `finished_recving` set (keyed by request id), which releases their pins;
a synchronous load's pins are released when every worker reported it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.layout import SKIP_BLOCK


@dataclass(frozen=True)
class ChunkCopy:
    """One batch of chunk copies for one request, between engine blocks and host slots.

    `block_ids[i]` are the `blocks_per_chunk` engine blocks of chunk i in token order, for each KV
    cache group in turn (a load's `SKIP_BLOCK` where a group holds none); `slots[i]` is its host
    row; `keys[i]` its chunk key (for logs, events and checks: copies need none). A load whose
    `slots` is empty could not pin its host rows: the worker fails it. A request's load may come
    in parts, one at a time (`streams.py`): the worker reports the request's load finished when
    its `last` part ends. A `sync` load feeds the forward pass of its own step (its request is in
    it): it is copied before that pass and never reported finished; a failed one's blocks are
    reported as load errors (one KV cache group only).
    """

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    last: bool = True
    sync: bool = False

    @property
    def all_block_ids(self) -> list[int]:
        return [b for chunk in self.block_ids for b in chunk if b != SKIP_BLOCK]


@dataclass(frozen=True)
class StateCopy:
    """One state segment copy (`kvtier.state_rows`) for one request: `block_ids[l]` is the block of
    recurrent layer l holding the state, `slots` the segment's host rows, `keys` their keys. A load
    whose `slots` is empty could not pin its rows: the worker fails the request's load."""

    job_id: int
    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """This step's work for the worker half.

    `loads` run in `start_load_kv` (host → device, for requests waiting for their KV); `stores` run
    in `wait_for_save`, after the forward pass computed the blocks (device → host). State copies
    (models with recurrent layers) run with them, before a request's chunk loads and after the
    forward pass. `releases` are finished requests whose blocks vLLM kept for kvtier's stores
    (`tails.py`): each is reported finished sending once every store planned for it, up to this
    step's, has ended.
    """

    region_name: str
    shm_dir: str
    loads: tuple[ChunkCopy, ...] = ()
    stores: tuple[ChunkCopy, ...] = ()
    state_loads: tuple[StateCopy, ...] = ()
    state_stores: tuple[StateCopy, ...] = ()
    releases: tuple[str, ...] = ()


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Copy jobs finished by workers: job id → (how many workers finished it, all succeeded), for
    stores and loads, and job id → the slowest worker's copy time in seconds."""

    stores: dict[int, tuple[int, bool]] = field(default_factory=dict)
    loads: dict[int, tuple[int, bool]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another worker's report: counts add up, one failure fails the job, the longest
        time is kept."""
        if not isinstance(other, KVTierWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KVTierWorkerMetadata")
        seconds = dict(self.seconds)
        for job_id, secs in other.seconds.items():
            seconds[job_id] = max(secs, seconds.get(job_id, 0.0))
        return KVTierWorkerMetadata(
            _merge(self.stores, other.stores), _merge(self.loads, other.loads), seconds
        )


def _merge(
    mine: dict[int, tuple[int, bool]], theirs: dict[int, tuple[int, bool]]
) -> dict[int, tuple[int, bool]]:
    merged = dict(mine)
    for job_id, (count, ok) in theirs.items():
        have_count, have_ok = merged.get(job_id, (0, True))
        merged[job_id] = (have_count + count, have_ok and ok)
    return merged
