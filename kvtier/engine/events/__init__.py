"""KV events for routers, independent of the engine's event format: which engine blocks a chunk
covers (`chunk_blocks`), kept on disk beside an fs tier's chunks (`block_sidecar`), and what the
request path asks of an integration that turns tier events into its engine's KV events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.engine.request import Request
from kvtier.format.chunks import ChunkKey, TierEvent


class EventTranslator(Protocol):
    """An integration's KV events for routers, built from tier events (vLLM's:
    `kvtier.integrations.vllm.kv_events.KVEventTranslator`)."""

    def remember(self, request: Request, keys: Sequence[ChunkKey], first: int = 0) -> None: ...
    def remember_unfull(self, request: Request, key: ChunkKey, chunk: int, blocks: int) -> None: ...
    def translate_all(self, events: list[tuple[str, TierEvent]]) -> list[Any]: ...
    def close(self) -> None: ...
