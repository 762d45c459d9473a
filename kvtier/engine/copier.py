"""The worker side of the request path: runs the chunk copies the scheduler side planned.

Runs in each engine worker (one per TP rank), on the worker's model-runner thread. It needs nothing
from the scheduler process but each step's `StepPlan`: the host region's name, and (block ids,
slots) pairs; it maps the region by name on first use.

Per step, in the engine's order (vLLM's hooks in parentheses): `before_forward`
(`handle_preemptions`, before the forward pass is launched), the forward pass, `start_load` (the
plan's loads, host → device; vLLM 0.32 calls it after launching the pass, and the loading requests
are not in it), `save` (its stores, device → host), then `take_finished_loads`,
`take_load_errors` and `take_report` report the copies that ended.

The copies themselves are `kvtier.transfer`'s, picked by the device of the KV tensors
(recurrent-state segments go through the same transfer, handed its `StateCopier`): on the CPU
they run synchronously, so every job of a step is reported in that step; on CUDA they are queued
on copy streams and each job is reported in the first report that finds it ended. A failed load's
blocks are reported no later than its request: vLLM asks for finished requests, then for load
errors, in each step, and a load found ended in between has its blocks reported first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.geometry import EngineGeometry
from kvtier.engine.step import CopyReport, StepPlan
from kvtier.format.layout import SKIP_BLOCK, TPShard
from kvtier.transfer import Transfer, make_transfer
from kvtier.transfer.copy_plan import CopyPlan, EngineLayout
from kvtier.transfer.state_copier import StateCopier

log = logging.getLogger("kvtier.copier")

TransferFactory = Callable[[CopyPlan, Sequence[torch.Tensor]], Transfer]


@dataclass(frozen=True)
class _Job:
    load: bool
    req_id: str
    block_ids: tuple[int, ...]
    last: bool = True
    sync: bool = False


class CopyDriver:
    """One rank's copies between its KV tensors and the shared host region."""

    def __init__(
        self, geometry: EngineGeometry, tp_rank: int, transfer_factory: TransferFactory = make_transfer
    ) -> None:
        self.geometry = geometry
        self.shard = TPShard(geometry.layout.num_kv_heads, geometry.tp_size, tp_rank)
        self.transfer: Transfer | None = None
        self._transfer_factory = transfer_factory
        self._jobs: dict[int, _Job] = {}
        self._finished_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._by_request = not geometry.one_group
        """Several KV cache groups: failed loads are reported by request, not by block."""
        self._failing: set[str] = set()
        self._failed_loads: set[str] = set()
        self._stores: dict[int, tuple[int, bool]] = {}
        self._loads: dict[int, tuple[int, bool]] = {}
        self._seconds: dict[int, float] = {}
        self._releasing: dict[str, int] = {}
        """Released requests (`StepPlan.releases`) → their stores still in flight."""
        self._finished_sends: set[str] = set()

    def register(
        self, kv_caches: Mapping[str, torch.Tensor], layout_of: Callable[[torch.Tensor], EngineLayout],
        states: StateCopier | None = None,
    ) -> None:
        """Build the copy plan and the transfer from the real tensors (layer name → tensor, read
        through the layout `layout_of` names for the first attention layer's tensor); `states`
        copies the recurrent layers' state segments. The kernel block size of each KV cache group
        is read from its tensors (`kernel_block_sizes`); block ids stay the engine's. Called once,
        after the engine allocated its KV cache and before the first step; raises ValueError for
        a layer without a tensor or one `layout` cannot view, NotImplementedError when the
        tensors' device has no transfer."""
        geometry = self.geometry
        missing = [name for name in geometry.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvtier: no KV cache tensor for layers {missing}")
        tensors = [kv_caches[name] for name in geometry.layer_names]
        layout = layout_of(tensors[0])
        kernel = kernel_block_sizes(geometry, layout, tensors)
        plan = CopyPlan(
            geometry.layout, layout, self.shard, geometry.block_size, geometry.layer_groups,
            kernel_block_sizes=kernel,
        )
        for layer, (name, kv) in enumerate(zip(geometry.layer_names, tensors, strict=True)):
            try:
                plan.engine_views(kv, plan.layer_groups[layer])
            except ValueError as exc:
                raise ValueError(f"kvtier: layer {name}: {exc}") from exc
        self.transfer = self._transfer_factory(plan, tensors)
        if states is not None:
            self.transfer.add_states(states)

    def before_forward(self) -> None:
        """Order the coming forward pass after the stores still reading its blocks. Called before
        each forward pass is launched (vLLM's `handle_preemptions`), also on steps without one."""
        if self.transfer is not None:
            self.transfer.before_forward()

    def start_load(self, meta: StepPlan) -> None:
        """Queue every load of `meta` host → device. Called once per step, by vLLM's
        `start_load_kv`: after launching the step's forward pass, which the loading requests are
        not in, or for synchronous loads before it, which then waits for them. A load without
        pinned host rows fails at once."""
        self._copy_states(meta, load=True)
        for job in meta.loads:
            self._jobs[job.job_id] = _Job(True, job.req_id, tuple(job.all_block_ids), job.last, job.sync)
            if job.slots:
                self._transfer(meta).submit_load(job.job_id, job.block_ids, job.slots)
            else:
                self._ended(job.job_id, False, 0.0)
        if any(job.sync and job.slots for job in meta.loads):
            self._transfer(meta).forward_reads_loads()
        self._collect()

    def save(self, meta: StepPlan) -> None:
        """Queue every store of `meta` device → host, state segments after chunks. Called once per
        step by vLLM's `wait_for_save`, after the forward pass that writes the blocks was launched."""
        if meta.stores or meta.state_stores:
            self._transfer(meta).forward_done()
        for job in meta.stores:
            self._jobs[job.job_id] = _Job(False, job.req_id, ())
            self._transfer(meta).submit_store(job.job_id, job.block_ids, job.slots)
        self._copy_states(meta, load=False)
        for req_id in meta.releases:
            self._releasing[req_id] = sum(1 for j in self._jobs.values() if not j.load and j.req_id == req_id)
            if not self._releasing[req_id]:
                del self._releasing[req_id]
                self._finished_sends.add(req_id)
        self._collect()

    def _copy_states(self, meta: StepPlan, load: bool) -> None:
        """Queue the step's state copies through the transfer, as chunks are (a load before the
        request's chunk loads, on the same stream: a failed one is reported first and fails the
        request's load); a load without pinned rows fails at once."""
        jobs = meta.state_loads if load else meta.state_stores
        if not jobs:
            return
        transfer = self._transfer(meta)
        for job in jobs:
            self._jobs[job.job_id] = _Job(load, job.req_id, (), last=False)
            if not job.slots:
                self._ended(job.job_id, False, 0.0)
            elif load:
                transfer.submit_state_load(job.job_id, job.block_ids, job.slots)
            else:
                transfer.submit_state_store(job.job_id, job.block_ids, job.slots)

    def _transfer(self, meta: StepPlan) -> Transfer:
        if self.transfer is None:
            raise RuntimeError("kvtier: a copy was planned before register")
        self.transfer.attach(meta.region_name, meta.shm_dir)
        return self.transfer

    def _collect(self) -> None:
        """Record the copies the transfer reports ended (never waits)."""
        if self.transfer is not None:
            for result in self.transfer.poll():
                self._ended(result.job_id, result.ok, result.seconds)

    def _ended(self, job_id: int, ok: bool, seconds: float) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            log.error("kvtier: the transfer reported unknown job %d", job_id)
            return
        self._seconds[job_id] = seconds
        if not job.load:
            self._stores[job_id] = (1, ok)
            if job.req_id in self._releasing:
                self._releasing[job.req_id] -= 1
                if not self._releasing[job.req_id]:
                    del self._releasing[job.req_id]
                    self._finished_sends.add(job.req_id)
            return
        if not ok:
            if self._by_request:
                self._failing.add(job.req_id)
            else:
                self._load_errors.update(b for b in job.block_ids if b != SKIP_BLOCK)
        self._loads[job_id] = (1, ok)
        if job.last and not job.sync:
            self._finished_loads.add(job.req_id)
            if job.req_id in self._failing:
                self._failing.discard(job.req_id)
                self._failed_loads.add(job.req_id)

    def take_finished_loads(self) -> set[str]:
        """Request ids whose loads ended (their last part, successfully or not) since the last
        call."""
        self._collect()
        done, self._finished_loads = self._finished_loads, set()
        return done

    def take_finished_sends(self) -> set[str]:
        """Released requests whose stores have all ended since the last call: vLLM may free their
        blocks."""
        self._collect()
        done, self._finished_sends = self._finished_sends, set()
        return done

    def take_failed_loads(self) -> set[str]:
        """Of the requests `take_finished_loads` returned, those whose load failed and must be
        recomputed whole: with several KV cache groups, where vLLM takes no block-level errors
        (block ids are per group). Call right after it."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def take_load_errors(self) -> set[int]:
        """Block ids whose loads failed since the last call (one KV cache group only); vLLM
        recomputes from the first of a request's."""
        self._collect()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> CopyReport | None:
        """This rank's finished copies since the last call, or None when there are none."""
        self._collect()
        if not self._stores and not self._loads:
            return None
        meta = CopyReport(self._stores, self._loads, self._seconds)
        self._stores, self._loads, self._seconds = {}, {}, {}
        return meta

    @property
    def copies_running(self) -> int:
        """Copy jobs queued and not yet ended."""
        return len(self._jobs)

    def shutdown(self) -> None:
        """Wait for the copies still running, then unmap the host region. Idempotent."""
        if self.transfer is not None:
            self.transfer.close()


def kernel_block_sizes(
    geometry: EngineGeometry, layout: EngineLayout, tensors: Sequence[torch.Tensor]
) -> tuple[int, ...]:
    """The tokens per block of each attention group's layer tensors (model order), as `layout`
    views them: `geometry.block_size`, or a divisor of it where the engine split each block into
    kernel blocks (the tensor then holds a whole number of kernel blocks per block). Raises
    ValueError naming the layer and the sizes when a tensor's blocks do not divide the block size,
    or two layers of one group disagree."""
    groups = geometry.layer_groups or (0,) * len(tensors)
    found: dict[int, tuple[str, int]] = {}
    block_size = geometry.block_size
    for name, kv, group in zip(geometry.layer_names, tensors, groups, strict=True):
        try:
            view = layout.kv_views(kv, geometry.layout.head_dim)[0]
        except ValueError as exc:
            raise ValueError(f"kvtier: layer {name}: {exc}") from exc
        blocks, tokens = int(view.shape[0]), int(view.shape[2])
        if tokens <= 0 or block_size % tokens or blocks % (block_size // tokens):
            raise ValueError(
                f"kvtier: layer {name}: tensor {tuple(kv.shape)} holds {blocks} blocks of {tokens} "
                f"tokens, which do not split the engine's blocks of {block_size} tokens"
            )
        first, size = found.setdefault(group, (name, tokens))
        if size != tokens:
            raise ValueError(
                f"kvtier: layers {first} and {name} of one KV cache group hold blocks of {size} "
                f"and {tokens} tokens"
            )
    return tuple(found[g][1] for g in range(len(found)))
