"""The host (primary) tier: a cache of chunk rows in the host region, one slot per chunk.

Every entry is in one of two states:

- WRITING: allocated by `reserve`, being filled. Pinned: never evicted, invisible to
  `lookup`/`contains`, not in the eviction policy. `commit` publishes it or frees its slot.
- READY: published, readable, indexed by the eviction policy. `pin` pins it (a reference
  count); `unpin` releases it. Only READY entries with no pin are eviction candidates.

Every READY entry has a retention priority (0-100, given at `commit`, raised by
`raise_priority`) and a `Retention`: published on probation (COLD, WARM) or SETTLED, and settled by
`settle` (reuse). Eviction takes probation entries first, then lower priorities first, and the
configured policy orders the entries within one class (`policies/classes.py`). Recency comes from
the requests that used the chunks, when they finish (`used_prefix`), and from publication.

Holds after every call: each slot is free, WRITING or READY, exactly one of them, and
free + WRITING + READY == capacity; the READY index and the policy hold the same key → slot pairs;
pins exist only on READY keys and are >= 1; uses wait only while stores are in flight, and the
chunks used by no request since published are READY. `check()` verifies all of it.

Threading: one owning thread (the scheduler's) makes every call; nothing here is thread-safe. Each
call costs time proportional to the keys it is given (and, when it evicts, to the pinned keys the
policy skips), never to the capacity; only the constructor and `check()` walk every slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile

from kvtier.errors import KVTierError
from kvtier.format.chunks import TierEvent, TierEventKind
from kvtier.policies.base import DEFAULT_PRIORITY, EvictionPolicy, Retention
from kvtier.policies.classes import PriorityClasses
from kvtier.policies.tenants import NO_SALT, TenantClasses, TenantShares


class HostTierError(KVTierError, RuntimeError):
    """The host tier was misused (a release without a pin) or found an invariant broken."""


@dataclass(frozen=True)
class HostTierStats:
    """A snapshot of slot usage. `used` counts READY and WRITING slots; `pinned` counts keys;
    `tenant_bytes`: the bytes of the rows each tenant id holds (empty without tenant shares)."""

    capacity: int
    used: int
    ready: int
    writing: int
    pinned: int
    row_bytes: int
    tenant_bytes: tuple[int, ...] = ()

    @property
    def used_bytes(self) -> int:
        return self.used * self.row_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.row_bytes


class _Protected:
    """Keys eviction must skip: the pinned ones plus the READY keys named by the current call."""

    __slots__ = ("_extra", "_pins")

    def __init__(self, pins: Container[bytes], extra: Container[bytes]) -> None:
        self._pins = pins
        self._extra = extra

    def __contains__(self, key: object) -> bool:
        return key in self._pins or key in self._extra


class HostTier:
    """Slots, reference counts and the two-phase store/load protocol over one host region buffer.

    `buf` holds `len(buf) // row_bytes` rows; row `s` is `buf[s*row_bytes:(s+1)*row_bytes]`, page
    aligned when `buf` is and `row_bytes` is a multiple of the page size. `policy` must be empty and
    is owned by the tier from now on; its capacity must be at least the number of slots.
    `generations` (uint64 per slot, `host.generations`): each slot's word is incremented whenever
    `reserve` hands the slot out, so other processes can tell a reused slot from its old row.
    `shares`: each tenant's share of the slots (`policies.tenants`; None: no tenants).
    """

    def __init__(self, buf: memoryview, row_bytes: int, policy: EvictionPolicy[int],
                 generations: memoryview | None = None, shares: TenantShares | None = None) -> None:
        if row_bytes < 1:
            raise ValueError(f"row_bytes must be >= 1, got {row_bytes}")
        num_slots = len(buf) // row_bytes
        if num_slots < 1:
            raise ValueError(f"a buffer of {len(buf)} bytes holds no row of {row_bytes} bytes")
        if len(policy) != 0:
            raise ValueError("the eviction policy must start empty")
        if policy.capacity < num_slots:
            raise ValueError(f"policy capacity {policy.capacity} is below {num_slots} slots")
        self._buf = buf
        self.row_bytes = row_bytes
        self.num_slots = num_slots
        tenants = None if shares is None else TenantClasses(policy, DEFAULT_PRIORITY, shares, num_slots)
        self._policy = PriorityClasses(policy, DEFAULT_PRIORITY) if tenants is None else tenants
        self._tenants = tenants
        self._ready: dict[bytes, int] = {}
        self._writing: dict[bytes, int] = {}
        self._pins: Counter[bytes] = Counter()
        # A stack: slot 0 is handed out first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._events: list[TierEvent] = []
        self._uses: list[list[bytes]] = []
        self._fresh: set[bytes] = set()  # READY, and used by no request since published
        if generations is not None and len(generations) < num_slots:
            raise ValueError(f"{len(generations)} slot generations for {num_slots} slots")
        self._generations = generations

    # Queries: no pin, no recency change.

    def lookup(self, keys: Sequence[bytes]) -> int:
        """The length of the leading run of `keys` that are READY."""
        return len(list(takewhile(self._ready.__contains__, keys)))

    def contains(self, key: bytes) -> bool:
        """Whether `key` is READY."""
        return key in self._ready

    def is_pending(self, key: bytes) -> bool:
        """Whether `key` is WRITING (allocated, not yet published)."""
        return key in self._writing

    # Store: device or secondary tier → host.

    def reserve(self, keys: Sequence[bytes], tenant: int = NO_SALT) -> dict[bytes, int] | None:
        """Allocate a WRITING slot for each key that is neither READY nor WRITING, held by `tenant`.

        Returns the new key → slot pairs (keys already present are left out, duplicates get one
        slot), or None when not enough slots can be freed: eviction takes unpinned READY entries
        that this call does not name, all-or-nothing, and a None result changes nothing. With
        tenant shares, eviction takes from tenants over their share first, and refuses (None) a
        `tenant` that would be over its own share once the over-share rows are taken.
        """
        ready, writing = self._ready, self._writing
        wanted = dict.fromkeys(keys)
        present = wanted.keys() & ready.keys()
        for key in present | (wanted.keys() & writing.keys()):
            del wanted[key]
        free = self._free
        count = len(wanted)
        shortfall = count - len(free)
        if shortfall > 0:
            protected: Container[bytes] = (
                _Protected(self._pins, present) if present else self._pins
            )
            held = [*self._pins, *present] if present else self._pins
            victims = (self._policy.evict(shortfall, protected, held) if self._tenants is None
                       else self._tenants.evict(shortfall, protected, held, tenant, count))
            if victims is None:
                return None
            evicted = [key for key, _ in victims]
            for key in evicted:
                del ready[key]
            self._fresh.difference_update(evicted)
            free.extend([slot for _, slot in victims])
            self._events.append(TierEvent(TierEventKind.REMOVED, tuple(evicted)))
        if not count:
            return {}
        taken = free[-count:]
        del free[-count:]
        taken.reverse()
        gens = self._generations
        if gens is not None:
            for slot in taken:
                gens[slot] += 1
        if self._tenants is not None:
            self._tenants.claim(taken, tenant)
        new = dict(zip(wanted, taken, strict=True))
        writing.update(new)
        return new

    def reserve_prefix(self, keys: Sequence[bytes], tenant: int = NO_SALT) -> tuple[dict[bytes, int], int]:
        """`reserve` for the longest leading run of `keys` that fits.

        Returns (new key → slot pairs, n): `keys[:n]` are READY or WRITING afterwards and the rest
        were left alone. A chunk is useful only after every chunk before it, so when pinned rows
        leave too little room, the first chunks are the ones worth a slot. Costs O(log² len(keys))
        `reserve` calls when room is short, one otherwise.
        """
        slots: dict[bytes, int] = {}
        done, total = 0, len(keys)
        step = total
        while done < total and step:
            step = min(step, total - done)
            got = self.reserve(keys[done : done + step], tenant)
            if got is None:
                step //= 2
                continue
            slots.update(got)
            done += step
        return slots, done

    def commit(
        self, keys: Sequence[bytes], success: bool, priority: int = DEFAULT_PRIORITY,
        probation: Mapping[bytes, Retention] | None = None,
    ) -> None:
        """Publish (success) or roll back the WRITING entries among `keys`; others are ignored.
        Published entries get retention `priority`, SETTLED unless `probation` names them."""
        writing = self._writing
        take = writing.pop
        done = {key: take(key) for key in keys if key in writing}
        if done and not success:
            self._free.extend(done.values())
            if self._tenants is not None:
                self._tenants.release(done.values())
        elif done:
            self._publish(done, priority, probation)
        if self._uses:
            self._apply_uses()

    def _publish(
        self, done: dict[bytes, int], priority: int, probation: Mapping[bytes, Retention] | None
    ) -> None:
        by_retention: dict[Retention, dict[bytes, int]] = {}
        for key, slot in done.items():
            retention = probation.get(key, Retention.SETTLED) if probation else Retention.SETTLED
            by_retention.setdefault(retention, {})[key] = slot
        for retention, part in by_retention.items():
            self._policy.insert_many(part, priority, retention)
        self._ready.update(done)
        self._fresh.update(done)
        self._events.append(TierEvent(TierEventKind.STORED, tuple(done)))

    # Load: host → device or secondary tier.

    def pin(self, keys: Sequence[bytes], *, access: bool = True) -> list[int] | None:
        """Pin every key and return its slot, in order; None (nothing pinned) if any is not READY.

        Counts as an access for the eviction policy unless `access` is False: a copy to a
        secondary tier is no reuse, and the connector records a request's use when the request
        finishes (`used_prefix`). A key named twice is pinned twice.
        """
        try:
            slots = list(map(self._ready.__getitem__, keys))
        except KeyError:
            return None
        self._pins.update(keys)
        if access:
            touch = self._policy.touch
            for key in keys:
                touch(key)
            self._fresh.difference_update(keys)
        return slots

    def used_prefix(self, keys: Sequence[bytes]) -> None:
        """A request has used the prefix `keys` (head first), from whichever cache served it: its
        READY chunks become the most recent, the head last, so eviction takes a prefix's tail
        before its head (a tail is useless without its head, which every request sharing the
        prefix needs). Chunks that are not READY then are left alone. A chunk's first use since it
        was published is no reuse (the request that stored it, or promoted it, is using it): it
        is refreshed, not accessed (`EvictionPolicy.refresh`; under ARC it stays "seen once").

        A use recorded while stores are in flight takes effect when the next of them completes,
        after its chunks: they rank before the use, as their allocation does in vLLM's CPU tier
        (vLLM finishes a step's requests before it reports the step's stores)."""
        self._uses.append(list(keys))
        if not self._writing:
            self._apply_uses()

    def _apply_uses(self) -> None:
        ready, fresh, policy = self._ready, self._fresh, self._policy
        uses, self._uses = self._uses, []
        for keys in uses:
            for key in reversed(keys):
                if key in fresh:
                    fresh.discard(key)
                    policy.refresh(key)
                elif key in ready:
                    policy.touch(key)

    def raise_priority(self, keys: Sequence[bytes], priority: int) -> int:
        """A request of retention `priority` reuses `keys`: READY keys of a lower priority move up
        to it (others are left alone). Returns how many moved."""
        lift = self._policy.raise_priority
        return sum(lift(key, priority) for key in keys)

    def settle(self, keys: Sequence[bytes]) -> dict[int, list[bytes]]:
        """Take the READY keys among `keys` off probation (a later request reused them); returns
        those that were on probation, by priority."""
        settled: dict[int, list[bytes]] = {}
        policy = self._policy
        for key in dict.fromkeys(keys):
            cls = policy.class_of(key)
            if cls is not None and policy.settle(key):
                settled.setdefault(cls[1], []).append(key)
        return settled

    def on_probation(self, key: bytes) -> bool:
        """Whether `key` is READY and on probation."""
        cls = self._policy.class_of(key)
        return cls is not None and cls[0] != Retention.SETTLED

    def priority_of(self, key: bytes) -> int | None:
        """The retention priority of a READY key, or None."""
        return self._policy.priority(key)

    def tenant_of(self, key: bytes) -> int | None:
        """The tenant id holding a READY key's row, or None (not READY, or no tenant shares)."""
        slot = self._ready.get(key)
        return None if slot is None or self._tenants is None else self._tenants.tenant_of[slot]

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Release one pin per key named (twice for a key named twice). Raises HostTierError,
        changing nothing, when a key would be released more often than it is pinned."""
        pins = self._pins
        counts = Counter(keys)
        for key, count in counts.items():
            held = pins[key]
            if count > held:
                raise HostTierError(f"unpin releases {key.hex()} {count} time(s); it holds {held} pin(s)")
        for key, count in counts.items():
            left = pins[key] - count
            if left:
                pins[key] = left
            else:
                del pins[key]

    def clear(self) -> int:
        """Drop every unpinned READY entry (vLLM's `reset_cache`); returns how many were dropped.

        Pinned READY entries (being read) and WRITING entries (being filled) stay: their owners
        still release them. The dropped keys are reported in one REMOVED event.
        """
        dropped = [key for key in self._ready if key not in self._pins]
        for key in dropped:
            self._policy.remove(key)
            self._free.append(self._ready.pop(key))
        self._fresh.difference_update(dropped)
        if dropped:
            self._events.append(TierEvent(TierEventKind.REMOVED, tuple(dropped)))
        return len(dropped)

    # Data, events, introspection.

    def slot_view(self, slot: int) -> memoryview:
        """The writable bytes of one row."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside the host tier's {self.num_slots} slots")
        start = slot * self.row_bytes
        return self._buf[start : start + self.row_bytes]

    def take_events(self) -> list[TierEvent]:
        """STORED and REMOVED batches since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> HostTierStats:
        ready, writing, row = len(self._ready), len(self._writing), self.row_bytes
        held = () if self._tenants is None else tuple(n * row for n in self._tenants.held)
        return HostTierStats(self.num_slots, ready + writing, ready, writing, len(self._pins), row, held)

    def pin_count(self, key: bytes) -> int:
        """How many `pin` pins `key` holds now."""
        return self._pins.get(key, 0)

    def check(self) -> None:
        """Raise HostTierError when an invariant of the module docstring does not hold."""
        ready, writing, free = self._ready, self._writing, self._free
        both = ready.keys() & writing.keys()
        if both:
            raise HostTierError(f"{len(both)} key(s) are both READY and WRITING")
        slots = [*ready.values(), *writing.values(), *free]
        if len(slots) != self.num_slots:
            raise HostTierError(
                f"free {len(free)} + READY {len(ready)} + WRITING {len(writing)} != "
                f"capacity {self.num_slots}"
            )
        if len(set(slots)) != self.num_slots or min(slots) < 0 or max(slots) >= self.num_slots:
            raise HostTierError("slots are not a disjoint cover of the region")
        for key, count in self._pins.items():
            if key not in ready:
                raise HostTierError(f"pinned key {key.hex()} is not READY")
            if count < 1:
                raise HostTierError(f"key {key.hex()} holds a pin count of {count}")
        policy = self._policy
        try:
            policy.check()
        except RuntimeError as e:
            raise HostTierError(str(e)) from e
        if self._uses and not writing:
            raise HostTierError("uses wait with no store in flight to take effect after")
        if not self._fresh <= ready.keys():
            raise HostTierError("a key used by no request since published is not READY")
        if self._tenants is not None and sum(self._tenants.held) != len(ready) + len(writing):
            raise HostTierError(f"tenants hold {sum(self._tenants.held)} rows, not READY + WRITING")
        if len(policy) != len(ready):
            raise HostTierError(f"policy holds {len(policy)} keys, READY index {len(ready)}")
        for key, slot in ready.items():
            if policy.get(key) != slot:
                raise HostTierError(f"policy maps {key.hex()} to {policy.get(key)}, not {slot}")
