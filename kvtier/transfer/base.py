"""The copy contract between one engine rank's KV tensors and the shared host region.

`Transfer` is what the connector's worker half drives, once per engine step and on the engine's
worker thread: `before_forward` (before the step's forward pass is launched), `forward_done` then
`submit_store` for each store (after the forward pass was launched), `submit_load` for each load,
and `poll` for the jobs that ended. A model with recurrent layers also hands the transfer its state
copier (`add_states`): state segments then go through `submit_state_store` and `submit_state_load`,
ordered and reported as the attention chunks are. A job's `CopyResult` comes out of `poll` exactly once, after
its bytes are in place (or, when it failed, after no copy of it can still be running).

Failures are values: a job that could not be copied is reported with `ok=False`, having logged the
cause; the caller fails the job and kvtier recomputes or skips the chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.transfer.copy_plan import CopyPlan
from kvtier.transfer.state_copier import StateCopier


@dataclass(frozen=True)
class CopyResult:
    """How a copy job ended: whether every chunk of it was copied, and how long the copy took."""

    job_id: int
    ok: bool
    seconds: float


class Transfer(ABC):
    """Copies chunks between one rank's KV tensors (one per layer, model order) and host rows.

    Every method is called on the engine worker's thread and returns without waiting for the
    accelerator. Job ids are unique among the jobs not yet reported by `poll`.
    """

    plan: CopyPlan
    states: StateCopier | None = None

    @abstractmethod
    def attach(self, region_name: str, shm_dir: str) -> None:
        """Map the host region `region_name` (once; again only if the name changes)."""

    @abstractmethod
    def submit_store(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Copy chunk i (engine blocks `block_ids[i]`) into host row `slots[i]`.

        Before: `forward_done` was called after the forward pass that wrote the blocks was launched;
        no other writer touches the rows. When `poll` reports the job ok, the rows hold this rank's
        heads in canonical format.
        """

    @abstractmethod
    def submit_load(self, job_id: int, block_ids: Sequence[Sequence[int]], slots: Sequence[int]) -> None:
        """Copy host row `slots[i]` into engine blocks `block_ids[i]`.

        Before: the rows are pinned READY and the blocks are allocated to a request outside the
        forward pass. The copy is ordered after every pass queued so far, stores or not. When
        `poll` reports the job ok, the blocks hold the chunks' KV; until `poll` reports it (ok or
        not), the rows must stay pinned and the blocks unread.
        """

    def add_states(self, copier: StateCopier) -> None:
        """Carry this rank's recurrent-layer state segments too, copied by `copier` (its tensors on
        the KV tensors' device). Called once, before the first state copy; ValueError when the
        copier's tensors live on another device."""
        devices = {t.device for parts in copier.tensors for t in parts}
        if devices != {copier.device} or copier.device != self.device:
            raise ValueError(f"state tensors on {sorted(map(str, devices))}, KV tensors on {self.device}")
        self.states = copier

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device of the KV tensors."""

    @abstractmethod
    def submit_state_store(self, job_id: int, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy the state segment of blocks `block_ids` (one per recurrent layer) into rows `slots`
        (one per row of the segment), as `submit_store` copies chunks: same before and after; a
        transfer without states (`add_states`) reports the job failed."""

    @abstractmethod
    def submit_state_load(self, job_id: int, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy the state segment in rows `slots` into blocks `block_ids`, as `submit_load` copies
        chunks; reported by `poll` before any load submitted after it."""

    @abstractmethod
    def poll(self) -> list[CopyResult]:
        """The jobs that ended since the last call, each reported once; never blocks."""

    def before_forward(self) -> None:
        """Called before each step's forward pass is launched; an asynchronous transfer orders the
        pass after the copies still reading blocks it may overwrite. No-op for synchronous copies."""

    def forward_reads_loads(self) -> None:
        """The coming forward pass reads the blocks of the loads submitted so far (synchronous
        loads, submitted before it is launched): an asynchronous transfer orders it after them.
        No-op for synchronous copies."""

    def forward_done(self) -> None:
        """Called once the step's forward pass was launched, before its stores are submitted.
        No-op for synchronous copies: the pass has run when vLLM calls `wait_for_save`."""

    @abstractmethod
    def close(self) -> None:
        """Wait for copies still running, then unmap the host region. Idempotent."""
