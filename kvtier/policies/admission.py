"""The built-in admission policies beyond `all`, and the chain that composes a list of them.

- `frequency` (TinyLFU style, with W-TinyLFU's window as probation): sightings are counted per chunk
  key in a bounded frequency sketch with aging (`sketch.py`), one per request that names the key.
  At the host gate it refuses nothing: a chunk is SETTLED when seen in at least `min_seen` requests
  (the request that computed it counts), else it waits on probation (`Retention`): WARM when the
  request that computed it continues a reused prefix (its first chunk was seen `min_seen` times),
  COLD otherwise. The host tier evicts probation chunks first, COLD before WARM, so one-off prompts
  push out each other, then a conversation's newest turn, and never a settled (reused) prefix. At a
  secondary tier's gate it admits a chunk seen `min_seen` times; a chunk on probation is not
  cascaded at all until a later request reuses it, when it settles and cascades (once).
- `priority`: a chunk is admitted into a tier only when its request's retention priority (0-100)
  is at least the tier's `min_retention_priority` (TensorRT-LLM's retention cut-off).

`AdmissionChain` asks each configured policy in order; a chunk is admitted only when all of them
admit it, and a rejection is attributed to the first policy that refused; it passes the manager's
news of each secondary tier's stores and events on to every policy. Its retention is the
lowest any policy gives, attributed to the first policy that gave it. Called on the scheduler
thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.format.chunks import HOST, TierEvent
from kvtier.policies.base import (
    DEFAULT_PRIORITY,
    AdmissionPolicy,
    AdmissionSettings,
    Retention,
)
from kvtier.policies.sketch import FrequencySketch


class FrequencyAdmission(AdmissionPolicy):
    """Probation at the host gate, `min_seen` sightings at the secondary tiers' gates."""

    name = "frequency"

    def __init__(
        self, settings: AdmissionSettings | None = None, sketch: FrequencySketch | None = None
    ) -> None:
        super().__init__(settings)
        self.sketch = sketch or FrequencySketch()

    def admit(self, key: bytes, tier: str, priority: int = DEFAULT_PRIORITY) -> bool:
        return tier == HOST or self.sketch.estimate(key) >= self.settings.min_seen

    def record_access(self, key: bytes) -> None:
        self.sketch.add(key)

    def retention(self, key: bytes, lead: bytes) -> Retention:
        # A chunk filled during decode was named by no request yet; its computing request saw it.
        min_seen = self.settings.min_seen
        if max(self.sketch.estimate(key), 1) >= min_seen:
            return Retention.SETTLED
        return Retention.WARM if self.sketch.estimate(lead) >= min_seen else Retention.COLD


class PriorityAdmission(AdmissionPolicy):
    """Admit a chunk into a tier when its priority is at least the tier's minimum."""

    name = "priority"

    def admit(self, key: bytes, tier: str, priority: int = DEFAULT_PRIORITY) -> bool:
        return priority >= self.settings.min_retention_priority.get(tier, 0)


class AdmissionChain:
    """A list of policies that must all admit a chunk."""

    def __init__(self, policies: Sequence[AdmissionPolicy]) -> None:
        self.policies = tuple(policies)

    def rejected_by(self, key: bytes, tier: str, priority: int) -> str | None:
        """The name of the first policy that refuses `key` for `tier`, or None when all admit."""
        for policy in self.policies:
            if not policy.admit(key, tier, priority):
                return policy.name
        return None

    def split(
        self, keys: Sequence[bytes], tier: str, priority: int
    ) -> tuple[list[bytes], dict[str, int]]:
        """The `keys` admitted into `tier` in order, and how many were rejected per policy."""
        if self.admits_all:
            return list(keys), {}
        admitted: list[bytes] = []
        rejected: dict[str, int] = {}
        for key in keys:
            reason = self.rejected_by(key, tier, priority)
            if reason is None:
                admitted.append(key)
            else:
                rejected[reason] = rejected.get(reason, 0) + 1
        for policy in self.policies:
            policy.admitted(tier, admitted)
        return admitted, rejected

    def probation(self, keys: Sequence[bytes], lead: bytes) -> dict[bytes, tuple[Retention, str]]:
        """The `keys` (just computed by a request whose first chunk is `lead`) that enter the host
        tier on probation: their retention and the first policy that gave it."""
        if self.admits_all:
            return {}
        out: dict[bytes, tuple[Retention, str]] = {}
        for key in keys:
            verdicts = [(policy.retention(key, lead), policy.name) for policy in self.policies]
            lowest = min(verdicts, key=lambda v: v[0])
            if lowest[0] != Retention.SETTLED:
                out[key] = lowest
        return out

    def record_access(self, key: bytes) -> None:
        for policy in self.policies:
            policy.record_access(key)

    def stores_ended(self, tier: str, keys: Sequence[bytes]) -> None:
        for policy in self.policies:
            policy.stores_ended(tier, keys)

    def tier_events(self, tier: str, events: Sequence[TierEvent]) -> None:
        for policy in self.policies:
            policy.tier_events(tier, events)

    @property
    def admits_all(self) -> bool:
        """Whether every chunk is admitted and settled whatever its key (no policy to ask)."""
        return all(policy.name == "all" for policy in self.policies)
