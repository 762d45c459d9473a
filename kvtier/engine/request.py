"""The request as kvtier's request path sees it: what an engine integration must expose per request.

vLLM's `vllm.v1.request.Request` has these attributes as they are; another engine adapts its own
request object to them. The request path only reads them, on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class LoraName(Protocol):
    """The LoRA adapter a request runs with: its name is part of every chunk key."""

    @property
    def lora_name(self) -> str: ...


class Request(Protocol):
    """One live request of the engine, read-only."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int] | None:
        """None when the prompt is given as embeddings (not cacheable by token ids)."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """The prompt's tokens then the output's so far: decode extends the keyed chunks."""

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the engine holds for this request (prefix hits and computed)."""

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def arrival_time(self) -> float:
        """Wall-clock seconds (`time.time()`) when the engine received the request."""

    @property
    def priority(self) -> int:
        """The engine's scheduling priority: lower values are served first."""

    @property
    def cache_salt(self) -> str | None:
        """The tenant's salt: requests with different salts never share a chunk."""

    @property
    def lora_request(self) -> LoraName | None: ...

    @property
    def mm_features(self) -> Sequence[Any] | None:
        """Multimodal inputs: a request with any is not cached (their hashes are not keyed yet)."""

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """Per-request connector options (`kvtier.engine.request_options`)."""
