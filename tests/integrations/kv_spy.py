"""`KVSpy`: the device KV bytes of every block of every chunk (by key) as the worker half stores
it and as its load leaves it, read from the engine's own layer tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.format.layout import SKIP_BLOCK


class KVSpy:
    """Wraps a worker half's `save` and `start_load` for the life of `mp`.

    `stored[key]`: each block's bytes (every layer) when the chunk was stored; `loaded[key]`: each
    block's bytes after its last load, None for a block the load skipped (`SKIP_BLOCK`: the
    device held it); `sync[key]`: whether that load was synchronous (copied before its request's
    forward pass)."""

    def __init__(self, worker: Any, mp: pytest.MonkeyPatch) -> None:
        self.stored: dict[bytes, list[bytes]] = {}
        self.loaded: dict[bytes, list[bytes | None]] = {}
        self.sync: dict[bytes, bool] = {}
        tensors = worker.transfer.layer_tensors
        save, start_load = worker.save, worker.start_load

        def block(b: int) -> bytes:
            return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)

        def spy_save(meta: Any) -> None:
            for job in meta.stores:
                for key, ids in zip(job.keys, job.block_ids, strict=True):
                    self.stored[key] = [block(b) for b in ids if b != SKIP_BLOCK]
            save(meta)

        def spy_load(meta: Any) -> None:
            start_load(meta)
            for job in meta.loads:
                for key, ids in zip(job.keys, job.block_ids, strict=True):
                    self.loaded[key] = [None if b == SKIP_BLOCK else block(b) for b in ids]
                    self.sync[key] = job.sync

        mp.setattr(worker, "save", spy_save)
        mp.setattr(worker, "start_load", spy_load)

    def written(self, key: bytes) -> list[bytes]:
        """The bytes of the blocks the last load of `key` wrote, in order."""
        return [b for b in self.loaded[key] if b is not None]
