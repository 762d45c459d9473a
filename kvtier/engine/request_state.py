"""One live request as the scheduler half tracks it: the keys of its full chunks known so far (the
prompt's, then those its decode fills), its options and retention priority, where its prompt
tokens came from, and how far its loads and stores have got."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.engine.accounting import RequestHits
from kvtier.engine.request import Request
from kvtier.engine.request_options import RequestOptions, retention_priority
from kvtier.format.chunks import HOST
from kvtier.format.keys import ChunkHasher
from kvtier.policies.tenants import NO_SALT, TenantShares


@dataclass(frozen=True)
class Unfull:
    """An unfull chunk (`kvtier.engine.unfull`): chunk index `chunk`, its first `blocks` engine
    blocks, its key, and where it came from ("host", or the tier that promoted it)."""

    chunk: int
    blocks: int
    key: bytes
    source: str = HOST


@dataclass
class RequestState:
    """A live request: the keys of its full chunks known so far (the prompt's, then those its
    decode fills), and how far loads and stores have got."""

    request: Request
    keys: list[bytes]
    lora: str | None
    options: RequestOptions
    hits: RequestHits
    priority: int
    load_from: int = 0
    load_offset: int = 0
    """Tokens of chunk `load_from` the device already holds (its hit ends inside that chunk, a
    multiple of the engine block): the load offers the rest of the chunk and skips those blocks."""
    stored: int = 0
    asked: int = 0
    """Chunks before this index were put to the host tier's admission (device → host gate)."""
    refused: set[int] = field(default_factory=set)
    """Indices of the chunks the host tier's admission refused: never stored for this request."""
    looked_up: int = 0
    promoted_from: dict[int, str] = field(default_factory=dict)
    """The source tier of each chunk promoted for this request, by chunk index."""
    promoted_at: int | None = None
    """The device hit (in chunks) of the last lookup that started a promotion (None: none did)."""
    streamed: range = range(0)
    """The chunks found in secondary tiers that did not fit in the host tier: streamed."""
    load_sync: bool = False
    """The last lookup offered a synchronous load (the host tier alone serves it)."""
    released: bool = False
    load_failed: bool = False
    """A load for this request failed (vLLM recomputes it): it is offered no load again."""
    unfull: Unfull | None = None
    """The unfull chunk the last lookup found in the host tier past the full ones: loaded too."""
    unfull_promoted: Unfull | None = None
    """The unfull chunk promoted for this request (once), held for it until `take_promoted`."""
    unfull_pending: bool = False
    """The last lookup's unfull chunk is being promoted or its tiers' answers are unknown."""
    unfull_due: Unfull | None = None
    """The unfull chunk the request finished with, still to store (a tail)."""
    waiting_since: float | None = None
    """When the request began waiting for the promotion its lookups answer "ask again" for."""
    patience: float | None = None
    """How long it may wait for it (None: whatever it takes; `kvtier.engine.load_choice.GiveUps`)."""
    gave_up_at: int | None = None
    """It gave up waiting for the chunks from this index: nothing past it is offered again."""
    tenant: int = NO_SALT
    """The tenant id of its `cache_salt` (`policies.tenants`), which holds the host rows it fills."""

    def may_promote(self, start: int) -> bool:
        """Whether a lookup from chunk `start` (vLLM's device hit now) may promote: once per
        request, and again only when the device hit has shrunk below the last promotion's start
        (vLLM evicted those blocks while the request waited). The chunks in between are then
        promoted too; without them the promoted chunks after them would be unusable and the whole
        prefix recomputed."""
        return self.promoted_at is None or start < self.promoted_at

    def record_promotion(self, start: int, ready: int, tiers: Sequence[str]) -> None:
        """A lookup from chunk `start` found `ready` chunks in the host tier and promotes the
        chunks after them from `tiers`. The ready ones count as promoted from the host tier: the
        promotion holds them too, and the request releases them with the rest. A lookup that chose
        to recompute chunks a tier held (`hits.by_choice`) counts as the request's promotion too:
        the choice is made once, however many steps the request waits."""
        if tiers:
            for i, tier in enumerate((*(HOST,) * ready, *tiers), start):
                if tier != HOST or i not in self.promoted_from:  # a tier's promotion replaces a hold
                    self.promoted_from[i] = tier
        if tiers or self.hits.by_choice:
            self.promoted_at = start

    def extend_keys(self, computed: int, hasher: ChunkHasher) -> int | None:
        """Key the full chunks that decode filled up to `computed` tokens; the index of the first
        new key (None: none)."""
        if computed // hasher.chunk_tokens <= len(self.keys):
            return None
        first, request = len(self.keys), self.request
        self.keys += hasher.extend(self.keys, request.all_token_ids[:computed],
                                   cache_salt=request.cache_salt, lora=self.lora)
        return first

    def loaded_chunks(self, num_external_tokens: int, chunk_tokens: int) -> int:
        """The chunks a load of `num_external_tokens` past the device hit covers (the first one
        in part when the hit ends inside it)."""
        if not num_external_tokens:
            return 0
        return (num_external_tokens + self.load_offset) // chunk_tokens

    def take_promoted(self, keep: range = range(0)) -> list[bytes]:
        """The chunks promoted for this request, whose holds are to be released, once (then none):
        its own load has pinned the rows it needs, or it no longer needs them. The chunks it
        streams (`keep`) stay held: the stream releases each as its part pins it, or when it ends."""
        unfull = [] if self.unfull_promoted is None or self.released else [self.unfull_promoted.key]
        if not (self.promoted_from or unfull) or self.released:
            return []
        self.released = True
        return unfull + [self.keys[i] for i in self.promoted_from if i not in keep]

    @classmethod
    def of(cls, request: Request, hasher: ChunkHasher, max_priority: int = 100,
           tenants: TenantShares | None = None) -> RequestState | None:
        """A new request's state, its prompt keyed, its retention priority at most `max_priority`
        (the operator's `max_client_priority`), its tenant by `tenants` (None: no shares, tenant
        0 and no tenant label); None when it cannot be cached (multimodal inputs or prompt
        embeddings are not hashed yet)."""
        if request.prompt_token_ids is None or request.mm_features:
            return None
        lora = request.lora_request.lora_name if request.lora_request else None
        keys = hasher.keys(request.prompt_token_ids, cache_salt=request.cache_salt, lora=lora)
        options = RequestOptions.from_params(request.request_id, request.kv_transfer_params)
        priority = min(retention_priority(options, request.priority), max_priority)
        if tenants is None:
            return cls(request, keys, lora, options, RequestHits(request.num_prompt_tokens), priority)
        salt = request.cache_salt
        hits = RequestHits(request.num_prompt_tokens, tenant=tenants.label_of(salt))
        return cls(request, keys, lora, options, hits, priority, tenant=tenants.tenant_of(salt))


def mark_load_failed(state: RequestState | None) -> None:
    """Record that a load of the request failed (no state: nothing to record)."""
    if state is not None:
        state.load_failed = True
