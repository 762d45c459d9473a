"""Where each request's prompt KV came from, and kvtier's metrics for one engine.

The scheduler half calls `Accounting` on the scheduler thread only; nothing here blocks.

Per request (`RequestHits`): the device prefix-cache hit vLLM reported to
`get_num_new_matched_tokens`, then the chunks kvtier loaded, each counted under the tier it came
from: "host" when it was in the host tier already, else the secondary tier (by name) that promoted
it for this request; a chunk whose load failed is recomputed. A chunk a tier held that
`load_policy: auto` chose to recompute (`kvtier.engine.load_choice`) is "recomputed_by_choice" (the
key is in the split under `auto` only). When the request finishes its split `{"device": n, "host":
n, <tier name>: n, ..., "recomputed_by_choice": n, "recomputed": n}` (prompt tokens; they add up
to the prompt length) is returned to the caller in the request output's `kv_transfer_params` under
`"kvtier": {"tokens": ...}`, kept for in-process readers in `Accounting.finished` (the last
`FINISHED_KEPT` requests, by request id) and added to the `kvtier_prompt_tokens{source=...}`
counters. Tier names default to the tier type (`"fs"`, `"obj"`, ...) unless configured.

With `tenants` (`kvtier.policies.tenants`), each split is also counted by tenant
(`kvtier_tenant_prompt_tokens{tenant, source}`: a named salt, `other` or `none`, so the labels are
bounded by the config), and every step sets the host bytes each tenant holds
(`kvtier_tenant_bytes{tier="host"}`; a secondary tier's are set by `policies.tier_shares`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvtier.format.chunks import DEVICE, HOST, RECOMPUTED
from kvtier.manager import TieringManager
from kvtier.ops.metrics import RECOMPUTED_BY_CHOICE
from kvtier.policies.tenants import TenantShares
from kvtier.tiers.base import TierUsage

FINISHED_KEPT = 4096


@dataclass
class RequestHits:
    """One request's prompt-token sources so far (see the module docstring)."""

    prompt_tokens: int
    device: int = 0
    loaded: Counter[str] = field(default_factory=Counter)
    by_choice: Counter[str] = field(default_factory=Counter)
    """Tokens recomputed by choice, by the tier that held them."""
    recorded: bool = False
    tenant: str | None = None
    """The request's `tenant` label (None: no `tenants` configured)."""

    def split(self, sources: list[str]) -> dict[str, int]:
        """Tokens by source, every source in `sources` present (0 when none)."""
        out = {DEVICE: self.device, **dict.fromkeys(sources, 0)}
        for source, tokens in self.loaded.items():
            out[source] = out.get(source, 0) + tokens
        if self.by_choice:
            out[RECOMPUTED_BY_CHOICE] = sum(self.by_choice.values())
        out[RECOMPUTED] = max(self.prompt_tokens - sum(out.values()), 0)
        return out


class Accounting:
    """Metrics of one engine's kvtier and the per-request hit records."""

    def __init__(self, manager: TieringManager, chunk_tokens: int, by_choice: bool = False,
                 tenants: TenantShares | None = None) -> None:
        """`by_choice`: `load_policy` is `auto`, so every split has "recomputed_by_choice";
        `tenants`: the configured shares, whose labels the per-tenant metrics use (None: none)."""
        self.manager = manager
        self.tenants = tenants
        self.chunk_tokens = chunk_tokens
        self.metrics = manager.metrics
        self.sources = [HOST, *manager.tiers, *([RECOMPUTED_BY_CHOICE] if by_choice else [])]
        self.finished: OrderedDict[str, dict[str, int]] = OrderedDict()

    def record_alloc(
        self, hits: RequestHits, looked_up: int, sources: list[str], skipped: int = 0, unfilled: int = 0
    ) -> None:
        """A request got its blocks: `looked_up` chunks were asked past the device hit and
        `sources[i]` served the i-th loaded chunk, the first one but its `skipped` tokens (the
        device held them), the last one but its `unfilled` tokens (an unfull chunk). Called once
        per request (first allocation)."""
        hits.recorded = True
        self._add(hits, sources, skipped, unfilled, 1)
        if looked_up:
            self.metrics.inc("lookups", 1)
            self.metrics.inc("lookup_chunks", looked_up)
        for tier, count in Counter(sources).items():
            self.metrics.inc("hit_chunks", count, tier)

    def load_failed(self, hits: RequestHits | None, sources: list[str], skipped: int = 0,
                    unfilled: int = 0) -> None:
        """A host → device load of chunks from `sources` (counted as `record_alloc` counts them)
        failed: vLLM recomputes them."""
        self.metrics.inc("failures", len(sources), HOST, "load")
        if hits is not None:
            self._add(hits, sources, skipped, unfilled, -1)

    def _add(self, hits: RequestHits, sources: list[str], skipped: int, unfilled: int, sign: int) -> None:
        last = len(sources) - 1
        for i, source in enumerate(sources):
            tokens = self.chunk_tokens - (skipped if i == 0 else 0) - (unfilled if i == last else 0)
            hits.loaded[source] += sign * tokens

    def copied(self, op: str, chunks: int, seconds: float, ok: bool) -> None:
        """Workers finished a device ↔ host copy job (`op` "store": device → host)."""
        if not ok:
            self.metrics.inc("failures", chunks, HOST, op)
            return
        row_bytes = self.manager.row_bytes
        self.metrics.inc("transfer_chunks", chunks, HOST, op)
        self.metrics.inc("transfer_bytes", chunks * row_bytes, HOST, op)
        self.metrics.inc("transfer_seconds", seconds, HOST, op)
        self.metrics.observe("transfer_latency_seconds", seconds, HOST, op)

    def store_rejected(self, chunks: int) -> None:
        """No host row could be freed for `chunks` device → host stores (all pinned); counted at
        every attempt."""
        self.metrics.inc("failures", chunks, HOST, "store")

    def finish(self, req_id: str, hits: RequestHits) -> dict[str, Any]:
        """The request finished: its split, also counted and kept; returns `kv_transfer_params`."""
        split = hits.split(self.sources)
        for source, tokens in split.items():
            self.metrics.inc("prompt_tokens", tokens, source)
            if hits.tenant is not None:
                self.metrics.inc("tenant_prompt_tokens", tokens, hits.tenant, source)
        for tier, tokens in hits.by_choice.items():
            self.metrics.inc("recomputed_by_choice_tokens", tokens, tier)
        self.finished[req_id] = split
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        return {"kvtier": {"tokens": dict(split)}}

    def step(self) -> None:
        """Once per engine step: occupancy of every tier (the manager counts its own transfers)."""
        host = self.manager.host_stats()
        self._set_occupancy(HOST, host.ready * host.row_bytes, host.ready, host.capacity_bytes)
        if self.tenants is not None:
            for label, held in zip(self.tenants.labels, host.tenant_bytes, strict=True):
                self.metrics.set("tenant_bytes", held, label, HOST)
        for name, tier in self.manager.tiers.items():
            self._occupancy(name, tier.last_usage)

    def _occupancy(self, name: str, usage: TierUsage | None) -> None:
        """A secondary tier's fill as of its last report (none before its first, or when the tier
        does not report usage)."""
        if usage is not None:
            self._set_occupancy(name, usage.bytes_used, usage.chunks, usage.capacity_bytes)

    def _set_occupancy(self, tier: str, used: float, chunks: float, capacity: float) -> None:
        m = self.metrics
        m.set("used_bytes", used, tier)
        m.set("used_chunks", chunks, tier)
        m.set("capacity_bytes", capacity, tier)
        m.set("used_fraction", used / capacity if capacity else 0.0, tier)
