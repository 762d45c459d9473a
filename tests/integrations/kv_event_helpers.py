"""Reading an engine's KV events as a router would: vLLM's own `KVEventBatch` decoder, and checks
that kvtier's events name the engine blocks vLLM's device events named."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.integrations.conftest import BLOCK_SIZE
from tests.integrations.shared_helpers import settle


def decoded(batches: list[Any]) -> list[Any]:
    """The events of `batches` as a consumer on vLLM's own `KVEventBatch` decoder reads them off
    the wire (msgpack, as vLLM's ZMQ publisher sends them)."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder, encoder = msgspec.msgpack.Decoder(type=KVEventBatch), msgspec.msgpack.Encoder()
    return [e for b in batches for e in decoder.decode(encoder.encode(b)).events]


def stored_by_medium(events: list[Any]) -> dict[str, list[Any]]:
    """The BlockStored events of the device (GPU), the host tier (CPU) and the fs tier (STORAGE)."""
    from vllm.distributed.kv_events import BlockStored

    return {m: [e for e in events if isinstance(e, BlockStored) and e.medium == m]
            for m in ("GPU", "CPU", "STORAGE")}


def assert_names_device_blocks(event: Any, device: list[int], prompt: list[int]) -> None:
    """`event` names a run of the blocks vLLM's device events named `device` (in prompt order), as
    vLLM would: int hashes, the parent before the run, the run's tokens, the engine block size."""
    assert all(type(h) is int for h in event.block_hashes), event
    i = device.index(event.block_hashes[0])
    n = len(event.block_hashes)
    assert event.block_hashes == device[i : i + n]
    assert event.parent_block_hash == (device[i - 1] if i else None)
    assert event.token_ids == prompt[i * BLOCK_SIZE : (i + n) * BLOCK_SIZE]
    assert (event.block_size, event.ownership, event.locality) == (BLOCK_SIZE, None, "LOCAL")


def sidecar_blocks(scheduler: Any, tier: str, key: bytes) -> Any:
    """The blocks tier `tier`'s sidecar file names for `key`, once its thread wrote it."""
    from kvtier.engine.events.block_sidecar import decode

    path = Path(scheduler.events.sidecars[tier].path(key))
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, f"no sidecar at {path}"
        time.sleep(0.02)
    return decode(path.read_bytes(), key, BLOCK_SIZE)


def tick(llm: Any) -> None:
    """One engine step without a full block: vLLM publishes events (kvtier's too) at each step."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(max_tokens=1), use_tqdm=False)


def promote(scheduler: Any, keys: list[bytes]) -> None:
    """What a request's lookup does: find `keys` in the secondary tiers and promote them."""
    deadline = time.monotonic() + 20
    while scheduler.manager.lookup_prefix(keys).pending:
        assert time.monotonic() < deadline, "the promotion did not end"
        time.sleep(0.02)
        scheduler.manager.poll()
    settle(scheduler)
    scheduler.manager.release(keys)
