"""A tiny engine's pieces, to drive the request path (`Planner`, `CopyDriver`) without an engine.

A tiny model (2 layers, 2 KV heads, head_dim 8, bf16) with 4-token blocks; `FakeRequest` has the
attributes `kvtier.engine.request.Request` reads; KV tensors are in vLLM's CPU layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.copier import CopyDriver, TransferFactory
from kvtier.engine.geometry import EngineGeometry
from kvtier.engine.step import StepPlan
from kvtier.format.keys import ModelFingerprint
from kvtier.format.layout import CanonicalLayout
from kvtier.integrations.vllm.model.backend_layouts import VllmCpuLayout
from kvtier.integrations.vllm.model.state_groups import StateWorker
from kvtier.transfer import make_transfer

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 4
ROW_BYTES = 4096  # 2 layers * 2 (K, V) * 2 heads * 4 tokens * 8 dims * 2 bytes = 512, padded
KEYS = (b"a" * 32, b"b" * 32)
"""Two chunk keys for the copies the copier tests make."""


def geometry(blocks_per_chunk: int = 1, tp_size: int = 1) -> EngineGeometry:
    fingerprint = ModelFingerprint("tiny", "", "torch.bfloat16", "torch.bfloat16", LAYERS, HEADS, HEAD_DIM)
    layout = CanonicalLayout(LAYERS, HEADS, HEAD_DIM, BLOCK * blocks_per_chunk, torch.bfloat16)
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    return EngineGeometry(fingerprint, layout, BLOCK, blocks_per_chunk, names, tp_size=tp_size)


def kv_caches(num_blocks: int, seed: int = 0, tp_rank: int | None = None) -> dict[str, torch.Tensor]:
    """Random per-layer tensors in vLLM's CPU shape `[num_blocks, H, block_size, 2 * D]`; with
    `tp_rank`, that rank's one-head shard (TP=2) of the same values."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, HEADS, BLOCK, 2 * HEAD_DIM)
    caches = {
        name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name in geometry().layer_names
    }
    if tp_rank is None:
        return caches
    return {name: kv[:, tp_rank : tp_rank + 1].contiguous() for name, kv in caches.items()}


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def copier(geo: EngineGeometry, tp_rank: int, caches: dict[str, torch.Tensor],
           factory: TransferFactory = make_transfer) -> CopyDriver:
    """A `CopyDriver` of rank `tp_rank` over `caches` (vLLM's CPU layout; a geometry with states
    finds their tensors in `caches` too), registered."""
    driver = CopyDriver(geo, tp_rank, factory)
    states = None if geo.states is None else StateWorker(geo.states, caches, tp_rank).copier
    driver.register(caches, lambda kv: VllmCpuLayout(), states)
    return driver


def store_in_child(region_name: str, shm_dir: str, job: Any, seed: int) -> tuple[int, bool]:
    """Run in a spawned process: a copier with `kv_caches(16, seed)` stores `job` into the
    host region it attaches by name; returns its acknowledgement for the job."""
    worker = copier(geometry(), 0, kv_caches(16, seed))
    worker.save(StepPlan(region_name, shm_dir, stores=(job,)))
    meta = worker.take_report()
    worker.shutdown()
    assert meta is not None
    return meta.stores[job.job_id]


def rank_store(region_name: str, job: Any, seed: int, tp_rank: int) -> tuple[int, bool]:
    """Run in a spawned process as TP rank `tp_rank` of 2: store `job` from this rank's shard of
    `kv_caches(16, seed)` into the shared host rows; return the acknowledgement."""
    worker = copier(geometry(tp_size=2), tp_rank, kv_caches(16, seed, tp_rank))
    worker.save(StepPlan(region_name, "/dev/shm", stores=(job,)))
    meta = worker.take_report()
    worker.shutdown()
    assert meta is not None
    return meta.stores[job.job_id]


def rank_load(region_name: str, job: Any, tp_rank: int) -> dict[str, torch.Tensor]:
    """Run in a spawned process as TP rank `tp_rank` of 2: load `job` into zeroed shard tensors;
    return the loaded blocks of every layer, in the job's block order."""
    caches = {name: torch.zeros_like(kv) for name, kv in kv_caches(16, 0, tp_rank).items()}
    worker = copier(geometry(tp_size=2), tp_rank, caches)
    worker.start_load(StepPlan(region_name, "/dev/shm", loads=(job,)))
    assert worker.take_load_errors() == set()
    worker.shutdown()
    return {name: kv[list(job.all_block_ids)].clone() for name, kv in caches.items()}
