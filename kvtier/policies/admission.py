"""The built-in admission policies beyond `all`, and the chain that composes a list of them.

- `frequency` (TinyLFU style): a chunk is admitted once its key was seen in at least `min_seen`
  requests within the recent window of a bounded frequency sketch (`sketch.py`), so one-off
  prompts do not push out prefixes that are reused.
- `priority`: a chunk is admitted into a tier only when its request's retention priority (0-100)
  is at least the tier's `min_retention_priority` (TensorRT-LLM's retention cut-off).

`AdmissionChain` asks each configured policy in order; a chunk is admitted only when all of them
admit it, and a rejection is attributed to the first policy that refused. Called on the scheduler
thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.policies.base import DEFAULT_PRIORITY, AdmissionPolicy, AdmissionSettings
from kvtier.policies.sketch import FrequencySketch


class FrequencyAdmission(AdmissionPolicy):
    """Admit a chunk once the recent-frequency estimate of its key reaches `min_seen`."""

    name = "frequency"

    def __init__(
        self, settings: AdmissionSettings | None = None, sketch: FrequencySketch | None = None
    ) -> None:
        super().__init__(settings)
        self.sketch = sketch or FrequencySketch()

    def admit(self, key: bytes, tier: str, priority: int = DEFAULT_PRIORITY) -> bool:
        return self.sketch.estimate(key) >= self.settings.min_seen

    def record_access(self, key: bytes) -> None:
        self.sketch.add(key)


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

    def record_access(self, key: bytes) -> None:
        for policy in self.policies:
            policy.record_access(key)

    @property
    def admits_all(self) -> bool:
        """Whether every chunk is admitted whatever its key (no policy to ask)."""
        return all(policy.name == "all" for policy in self.policies)
