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

from kvtier.engine.copies import ChunkCopy, StateCopy


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """This step's work for the worker half.

    `loads` run in `start_load_kv` (host → device, for requests waiting for their KV); `stores` run
    in `wait_for_save`, after the forward pass computed the blocks (device → host). State copies
    (models with recurrent layers) run with them, before a request's chunk loads and after the
    forward pass. `releases` are finished requests whose blocks vLLM kept for kvtier's stores
    (`kvtier.engine.tails`): each is reported finished sending once every store planned for it, up to this
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
