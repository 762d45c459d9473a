"""The tiering manager: one view over the host tier and the secondary tiers, engine-agnostic.

The one owner of the host tier: the request path (`kvtier.engine`) reaches host rows only through
the row calls below (`pin_rows`, `reserve_rows`, ...). Called on the scheduler thread only; it
waits on that thread in two bounded places alone: a lookup waits up to `lookup_wait_s` for tiers'
answers, and `await_promotions` up to the caller's timeout (`promotion_wait_s`).
- `lookup_prefix(keys)` finds how many leading chunks are ready in the host tier and, beyond them,
  which chunks the secondary tiers hold; it starts promoting those (secondary → host, the host slots
  allocated before the load and released if it fails) and reports them as pending until done.
- `publish(keys)` publishes a device → host store (settled or on probation, as the admission
  policies say) and `cascade(keys)` copies settled chunks to every secondary tier that admits them,
  keeping the host slots pinned for reading until each copy finishes.
- `poll()` drains the tiers' completions and finishes promotions and cascades.

A tier that fails or is down only turns its hits into misses: the engine recomputes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvtier.format.chunks import HOST, ChunkKey, TierEvent
from kvtier.host.region import HostRegion
from kvtier.host.tier import HostTier, HostTierStats
from kvtier.ops.metrics import KVTierMetrics
from kvtier.policies.admission import AdmissionChain
from kvtier.policies.base import DEFAULT_PRIORITY, AdmitAll
from kvtier.policies.remembered import RememberedPriorities
from kvtier.tiers.base import JobKind, JobResult, LookupResult
from kvtier.tiers.process import TierProcess
from kvtier.tiers.transfers import LoadTimer, Transfers

log = logging.getLogger("kvtier.manager")


@dataclass(frozen=True)
class PrefixLookup:
    """The answer for a request's chunk keys: `ready` leading chunks are in the host tier now.
    `pending` holds when more may become ready soon (a promotion or a tier lookup is in flight): ask
    again on a later step. `promoting` names the source of each chunk after the `ready` ones whose
    promotion this call started (chunk `ready + i` from `promoting[i]`; "host" for one the host tier
    held behind a missing one, now held for the caller), so a caller can tell hits from promotions."""

    ready: int
    pending: bool
    promoting: tuple[str, ...] = ()
    beyond: tuple[str, ...] = ()
    """For a caller that streams: the source tier of each chunk after the `promoting` ones that a
    tier holds but the host tier had no room for now (to promote later with `promote`)."""


class TieringManager:
    """Lookups across tiers, promotions into the host tier and cascades out of it."""

    def __init__(self, host: HostTier, tiers: Sequence[TierProcess], admission: AdmissionChain | None = None,
                 metrics: KVTierMetrics | None = None, lookup_wait_s: float = 0.0) -> None:
        self.host = host
        self.tiers = {t.name: t for t in tiers}
        if len(self.tiers) != len(tiers) or HOST in self.tiers:
            raise ValueError(f"tier names must be unique and not {HOST!r}")
        self.admission = admission or AdmissionChain([AdmitAll()])
        self.job_ids = itertools.count(1)
        """The one job-id space: tier jobs and the request path's copy jobs draw from it."""
        self._events: list[tuple[str, TierEvent]] = []
        self._claimed: set[ChunkKey] = set()
        """Keys being promoted for a caller that has not released them: held once loaded."""
        self._held: set[ChunkKey] = set()
        """Promoted keys pinned in the host tier until their caller releases them."""
        self.lookup_wait_s = lookup_wait_s
        """How long a lookup may wait for tiers' answers before it answers "ask again"."""
        self.metrics = metrics or KVTierMetrics()
        """Where every transfer, failure and refusal of this manager is counted."""
        self._transfers = Transfers(self.metrics, self.job_ids)
        self.region: HostRegion | None = None
        self.priorities = RememberedPriorities()
        """The priority each chunk was cascaded with: a promoted chunk gets it back."""
        self._disabled: set[str] = set()
        self.cascades = True  # False on an instance keeping its chunks in the host tier (`kv_consumer`)
        for name in self.tiers:
            self.metrics.set("tier_enabled", 1.0, name)

    def shutdown(self) -> None:
        """Stop every tier process, then remove the host region. Idempotent."""
        for tier in reversed(list(self.tiers.values())):
            tier.shutdown()
        if self.region is not None:
            self.region.close()
            self.region = None

    # -- lookups and promotions ----------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[ChunkKey], tiers: Collection[str] | None = None,
                      promote: bool = True, stream: bool = False, priority: int = DEFAULT_PRIORITY,
                      choose: Callable[[Sequence[str]], int] | None = None, tenant: int = 0) -> PrefixLookup:
        """How many leading `keys` are ready in the host tier; promote what follows if found.

        `tiers` restricts which secondary tiers may serve (None: all of them). With `promote` False
        the answer is what the host tier holds now (and the promotions in flight): a caller whose
        promotion already ran takes what it brought rather than evicting to promote again. `choose`,
        given the source tier of each chunk of the run found, says how many leading ones to promote.
        The chunks found that do not fit in the host tier now are refused (counted), or with `stream`
        reported in `beyond` for the caller to `promote` once room is freed. A promoted chunk gets
        the retention priority it was cascaded with, or the caller's `priority` when higher or unknown,
        its host row held by the caller's `tenant` (`HostTier.reserve`)."""
        ready = self.host.lookup(keys)
        rest = keys[ready:]
        if rest and self.host.is_pending(rest[0]):
            return PrefixLookup(ready, pending=True)
        sources, pending = self._find(rest, tiers) if rest and promote else ([], False)
        if sources and not pending and choose is not None:
            sources = sources[: choose(sources)]
        promoting: tuple[str, ...] = ()
        beyond: tuple[str, ...] = ()
        if sources and not pending:
            # Only a fully known run is promoted: the caller promotes once per request, so a
            # promotion started on a partial answer would cap the hit at its first chunks.
            fitted = self._promote(keys[:ready], rest[: len(sources)], sources, priority, tenant)
            promoting = tuple(HOST if self.host.contains(rest[i]) else sources[i] for i in range(fitted))
            if stream:
                beyond = tuple(sources[fitted:])
            else:
                self.metrics.inc("promotion_refused_chunks", len(sources) - fitted)
            pending = fitted > 0
        return PrefixLookup(ready, pending, promoting, beyond)

    def promote(self, keys: Sequence[ChunkKey], sources: Sequence[str], priority: int = DEFAULT_PRIORITY,
                tenant: int = 0) -> int:
        """Start promoting the leading `keys` that fit in the host tier, chunk i from `sources[i]`
        (`priority`, `tenant` as `lookup_prefix`); how many fitted (0: no room), each held till `release`d."""
        return self._promote((), keys, sources, priority, tenant)

    def await_promotions(self, keys: Sequence[ChunkKey], timeout_s: float) -> None:
        """Block up to `timeout_s` until the promotions of `keys` in flight ended, then `poll`:
        the one wait on the scheduler thread a caller chooses (`promotion_wait_s`)."""
        deadline = time.monotonic() + timeout_s
        for name, tier in self.tiers.items():
            if jobs := self._transfers.ids_touching(name, keys):
                tier.await_jobs(jobs, max(deadline - time.monotonic(), 0.0))
        self.poll()

    def promoting_tier(self, key: ChunkKey) -> str | None:
        """The tier a promotion in flight loads `key` from (None: no promotion loads it)."""
        return self._transfers.load_source(key) if self.host.is_pending(key) else None

    def _find(self, keys: Sequence[ChunkKey], tiers: Collection[str] | None) -> tuple[list[str], bool]:
        """The source tier of each leading key some tier holds; whether the run stopped on an unknown."""
        names, answers = self._answers(keys, tiers)
        sources: list[str] = []
        for i, key in enumerate(keys):
            if self.host.is_pending(key):
                return sources, True
            found = next((n for n in names if answers[n][i] is LookupResult.HIT), None)
            if found is None:
                unknown = any(answers[n][i] is LookupResult.RETRY for n in names)
                return sources, unknown
            sources.append(found)
        return sources, False

    def locate(self, keys: Sequence[ChunkKey], tiers: Collection[str] | None = None
               ) -> list[str | LookupResult]:
        """Where each of `keys` is, each on its own (not a prefix): "host" when the host tier holds
        it readable, else the first enabled secondary tier (of `tiers`; None: all) holding it, else
        MISS, or RETRY while the host tier is writing it or a tier is silent after `lookup_wait_s`."""
        names, answers = self._answers(keys, tiers)
        out: list[str | LookupResult] = []
        for i, key in enumerate(keys):
            if self.host.lookup([key]):
                out.append(HOST)
                continue
            found = [answers[n][i] for n in names]
            hit = next((n for n, a in zip(names, found, strict=True) if a is LookupResult.HIT), None)
            unknown = self.host.is_pending(key) or LookupResult.RETRY in found
            out.append(hit or (LookupResult.RETRY if unknown else LookupResult.MISS))
        return out

    def _answers(self, keys: Sequence[ChunkKey], tiers: Collection[str] | None
                 ) -> tuple[list[str], dict[str, list[LookupResult]]]:
        """The enabled tiers asked (of `tiers`), each one's answer per key (waited up to `lookup_wait_s`)."""
        names = [n for n in self.tiers if (tiers is None or n in tiers) and n not in self._disabled]
        answers = {n: self.tiers[n].lookup(keys) for n in names}
        asking = [n for n in names if LookupResult.RETRY in answers[n]]
        if asking and self.lookup_wait_s > 0:
            deadline = time.monotonic() + self.lookup_wait_s
            for n in asking:
                self.tiers[n].await_answers(max(deadline - time.monotonic(), 0.0))
                answers[n] = self.tiers[n].lookup(keys)
        return names, answers

    def _promote(self, ready: Sequence[ChunkKey], keys: Sequence[ChunkKey], sources: Sequence[str],
                 priority: int, tenant: int) -> int:
        """Allocate host slots for the leading `keys` that fit and load each from its source tier;
        how many fitted. When any did, the `ready` chunks before them and the READY ones of `keys`
        are held like the promoted ones (`release`): no store evicts the prefix the promotion
        extends meanwhile. A chunk is useful only after every chunk before it: when the host tier
        cannot take them all, the first ones are promoted; the rest are the caller's to stream
        (`promote` later) or recompute."""
        host = self.host
        slots, fitted = host.reserve_prefix([*ready, *keys], tenant)
        fitted -= len(ready)
        run = [*ready, *keys[:fitted]] if fitted > 0 else []
        present = [k for k in run if k not in slots and k not in self._held and host.contains(k)]
        if present and host.pin(present, access=False) is not None:
            self._held.update(present)
        by_tier: dict[str, list[ChunkKey]] = {}
        for key, source in zip(keys[:fitted], sources, strict=False):
            if key in slots:
                by_tier.setdefault(source, []).append(key)
        for name, tier_keys in by_tier.items():
            if name not in self.tiers:  # no tier to load from: these chunks are recomputed
                self.host.commit(tier_keys, False)
                self.metrics.inc("failures", len(tier_keys), HOST, "load")
                continue
            job = self._transfers.add(name, JobKind.LOAD, tier_keys, [slots[k] for k in tier_keys], priority)
            self._claimed.update(tier_keys)
            self.tiers[name].submit_load(job)
        return fitted

    # -- admission and cascades ----------------------------------------------------------------

    def record_request(self, keys: Sequence[ChunkKey]) -> None:
        """A request whose prompt has these chunk keys arrived: called once per request. Counts
        the sightings for the admission policies; the host chunks among them that were on
        probation are reused: they settle and cascade now (their first and only cascade)."""
        for key in keys:
            self.admission.record_access(key)
        for priority, group in self.host.settle(keys).items():
            self.metrics.inc("probation_reused_chunks", len(group), HOST)
            self.cascade(group, priority)

    def admit(self, keys: Sequence[ChunkKey], tier: str, priority: int) -> list[ChunkKey]:
        """The `keys` the admission policies let into `tier` ("host" or a secondary tier's name)
        for a request of retention `priority`, in order; admitted and rejected chunks are counted."""
        admitted, rejected = self.admission.split(keys, tier, priority)
        for reason, count in rejected.items():
            self.metrics.inc("rejected_chunks", count, tier, reason)
        self.metrics.inc("admitted_chunks", len(admitted), tier)
        return admitted

    def publish(self, keys: Sequence[ChunkKey], ok: bool, priority: int, lead: ChunkKey | None) -> None:
        """Publish (ok) or roll back the device → host store of `keys`; cascade the published chunks
        not on probation. `lead`: the first chunk of the request that computed them, for the
        policies' probation verdicts (None: all settled). A chunk on probation counts as rejected
        by every enabled secondary tier (reason: the policy that put it there) until it settles."""
        waiting = self.admission.probation(keys, lead) if ok and lead is not None else {}
        self.host.commit(keys, ok, priority, {k: r for k, (r, _) in waiting.items()})
        if ok:
            for reason, count in Counter(reason for _, reason in waiting.values()).items():
                self.metrics.inc("probation_chunks", count, HOST, reason)
                for name in self.tiers.keys() - self._disabled:
                    self.metrics.inc("rejected_chunks", count, name, reason)
            self.cascade([k for k in keys if k not in waiting], priority)

    def cascade(self, keys: Sequence[ChunkKey], priority: int = DEFAULT_PRIORITY,
                skip: str | None = None) -> None:
        """Copy host-resident `keys` to every secondary tier (but `skip`) that admits them; none
        where `cascades` is off."""
        self.priorities.remember(keys, priority)
        for name, tier in self.tiers.items():
            if name == skip or name in self._disabled or not self.cascades:
                continue
            admitted = self.admit(keys, name, priority)
            resident = [k for k in admitted if self.host.contains(k)]
            self.metrics.inc("cascade_skipped_chunks", len(admitted) - len(resident), name)
            slots = self.host.pin(resident, access=False) if resident else None
            if slots is not None:
                tier.submit_store(self._transfers.add(name, JobKind.STORE, resident, slots, priority))

    # -- host rows, for the request path -------------------------------------------------------

    @property
    def row_bytes(self) -> int:
        return self.host.row_bytes

    def host_stats(self) -> HostTierStats:
        return self.host.stats()
    def ready_prefix(self, keys: Sequence[ChunkKey]) -> int | None:
        """How many leading `keys` the host tier holds readable; None while one is being written."""
        return None if any(self.host.is_pending(k) for k in keys) else self.host.lookup(keys)

    def pin_rows(self, keys: Sequence[ChunkKey], access: bool = False) -> list[int] | None:
        """Pin the rows of `keys` for a host → device copy (all or none: None when one is missing);
        `access` counts it as a use for eviction. Each pin is undone by `unpin_rows`."""
        return self.host.pin(keys, access=access)

    def unpin_rows(self, keys: Sequence[ChunkKey]) -> None:
        self.host.unpin(keys)
    def reserve_rows(self, keys: Sequence[ChunkKey], tenant: int = 0) -> tuple[dict[ChunkKey, int], int]:
        """Rows, held by `tenant`, for a device → host store of the leading `keys` that fit: (key → slot for
        those not held already, how many leading keys fitted). Each is `publish`ed or `abandon_rows`."""
        return self.host.reserve_prefix(keys, tenant)

    def abandon_rows(self, keys: Sequence[ChunkKey]) -> None:
        """Roll back rows `reserve_rows` gave and no copy will fill."""
        self.host.commit(keys, False)

    def raise_priority(self, keys: Sequence[ChunkKey], priority: int) -> None:
        self.host.raise_priority(keys, priority)

    def used(self, keys: Sequence[ChunkKey]) -> None:
        """A finished request read or wrote `keys`: one use each, for eviction."""
        self.host.used_prefix(keys)

    def clear_host(self) -> int:
        """Drop every unpinned host row; how many were dropped."""
        return self.host.clear()

    # -- switching tiers ------------------------------------------------------------------------

    def tier_names(self) -> list[str]:
        """The secondary tiers in configured order (the newest last)."""
        return list(self.tiers)

    def is_enabled(self, name: str) -> bool:
        return name in self.tiers and name not in self._disabled

    def set_enabled(self, name: str, enabled: bool) -> None:
        """Let tier `name` take loads and stores, or stop it (it keeps its data; its jobs in flight
        finish). Raises KeyError for an unknown name."""
        if name not in self.tiers:
            raise KeyError(f"no secondary tier named {name!r}; known: {', '.join(self.tiers)}")
        (self._disabled.discard if enabled else self._disabled.add)(name)
        self.metrics.set("tier_enabled", 1.0 if enabled else 0.0, name)

    # -- completions ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Finish every transfer whose job completed; collect events."""
        for name, tier in self.tiers.items():
            for result in tier.get_finished_jobs():
                self._finish(result)
            self.admission.tier_events(name, events := tier.take_events())
            self._events.extend((name, e) for e in events)
        self._events.extend((HOST, e) for e in self.host.take_events())

    def _finish(self, result: JobResult) -> None:
        taken = self._transfers.take(result)
        if taken is None:
            return
        transfer, done, failed = taken
        if transfer.kind is JobKind.STORE:
            self.host.unpin(transfer.keys)
            self.admission.stores_ended(transfer.tier, transfer.keys)
            return
        by_priority: dict[int, list[ChunkKey]] = {}
        for key in done:
            kept = max(self.priorities.get(key, transfer.priority), transfer.priority)
            by_priority.setdefault(kept, []).append(key)
        for priority, keys in by_priority.items():
            self.host.commit(keys, success=True, priority=priority)
        self.host.commit(failed, success=False)
        self._claimed.difference_update(failed)
        hold = [k for k in done if k in self._claimed]
        self._claimed.difference_update(hold)
        if hold and self.host.pin(hold, access=False) is not None:
            self._held.update(hold)
        for priority, keys in by_priority.items():
            self.cascade(keys, priority, skip=transfer.tier)

    def release(self, keys: Sequence[ChunkKey]) -> None:
        """Release the hold a promotion puts on each of `keys` (keys without one are ignored): a
        promoted chunk stays pinned from the end of its promotion until its caller pinned the rows
        for its own load or gave up, so nothing evicts it in between. A key released while its
        promotion is in flight is not held when that promotion ends."""
        unique = set(keys)
        self._claimed -= unique
        held = [k for k in unique if k in self._held]
        self._held.difference_update(held)
        if held:
            self.host.unpin(held)

    def take_events(self) -> list[tuple[str, TierEvent]]:
        """(tier name or "host", event) in the order they were seen since the last call."""
        self.poll()
        events, self._events = self._events, []
        return events

    @property
    def in_flight(self) -> int:
        return len(self._transfers)

    @property
    def load_timer(self) -> LoadTimer | None:
        """Called with (tier, bytes, seconds) for every finished load job."""
        return self._transfers.load_timer

    @load_timer.setter
    def load_timer(self, timer: LoadTimer | None) -> None:
        self._transfers.load_timer = timer

    def jobs_in_flight(self) -> dict[str, int]:
        """Jobs submitted and not finished, per secondary tier (every tier named)."""
        return self._transfers.by_tier(self.tiers)
