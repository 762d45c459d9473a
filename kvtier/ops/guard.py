"""The SLO guard: the rollback rule that turns a secondary tier off when it hurts tail latency.

Config `slo_guard`: budgets `ttft_p99_s` and/or `itl_p99_s` (seconds), `window_s` (the sliding
window the p99s are taken over), `sustain_s` (how long a p99 must stay over its budget before the
guard acts), `action` and `cooldown_s`.

The engine integration feeds it one sample per request for time to first token (`observe_ttft`)
and one per decode observation for inter-token latency (`observe_itl`), and calls `check` once per
engine step. When a p99 stays over its budget for `sustain_s`:

- `disable_newest_tier`: the newest enabled secondary tier (the last one in `secondary_tiers`)
  stops taking loads and stores; it keeps its data. One warning names it and the p99 seen;
  `kvtier_tier_enabled{tier}` goes to 0 and `kvtier_slo_rollbacks_total` counts it. The window is
  cleared: what follows is measured without that tier. A tier the guard disabled is enabled again
  once every p99 is back under its budget, `cooldown_s` after it was disabled and after the
  previous restore (the last one disabled first).
- `alert`: the same warning, counted in `kvtier_slo_alerts_total`; nothing is switched.

`kvtier_slo_over_budget` is 1 while a p99 is over its budget. Called on the scheduler thread
only; `state()` gives a JSON-able snapshot for operators.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvtier.errors import ConfigError, unknown_name_message
from kvtier.ops.metrics import KVTierMetrics

log = logging.getLogger("kvtier.ops.guard")

ACTIONS = ("disable_newest_tier", "alert")
SIGNALS = ("ttft", "itl")
CHECK_INTERVAL_S = 0.1
"""The p99s are recomputed at most this often (a sort of the window's samples)."""


@dataclass(frozen=True)
class SLOGuardConfig:
    """Validated `slo_guard` settings; at least one budget is set."""

    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    window_s: float = 60.0
    sustain_s: float = 30.0
    action: str = "disable_newest_tier"
    cooldown_s: float = 300.0

    @classmethod
    def from_dict(cls, raw: object, key: str = "slo_guard") -> SLOGuardConfig:
        """Parse `raw`; a ConfigError names the dotted key (`slo_guard.window_s`) and the value."""
        if not isinstance(raw, Mapping):
            raise ConfigError(key, raw, 'must be an object such as {"ttft_p99_s": 2.0}')
        known = [name for name in cls.__dataclass_fields__]
        for name in raw:
            if name not in known:
                raise ConfigError(f"{key}.{name}", raw[name], unknown_name_message(str(name), known))
        if raw.get("ttft_p99_s") is None and raw.get("itl_p99_s") is None:
            raise ConfigError(key, dict(raw), "needs ttft_p99_s and/or itl_p99_s (seconds)")
        action = raw.get("action", "disable_newest_tier")
        if action not in ACTIONS:
            raise ConfigError(f"{key}.action", action, f"one of {', '.join(ACTIONS)}")

        def seconds(name: str, default: float | None, zero_ok: bool = False) -> Any:
            value = raw.get(name, default)
            if value is None:
                return None
            ok = not isinstance(value, bool) and isinstance(value, int | float)
            if not ok or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
                allowed = "a finite number >= 0" if zero_ok else "a finite number > 0"
                raise ConfigError(f"{key}.{name}", value, f"must be {allowed} (seconds)")
            return float(value)

        return cls(
            ttft_p99_s=seconds("ttft_p99_s", None), itl_p99_s=seconds("itl_p99_s", None),
            window_s=seconds("window_s", 60.0), sustain_s=seconds("sustain_s", 30.0, zero_ok=True),
            action=action, cooldown_s=seconds("cooldown_s", 300.0, zero_ok=True),
        )


class TierSwitch(Protocol):
    """What the guard switches: the tiering manager's secondary tiers, in configured order."""

    def tier_names(self) -> Sequence[str]: ...
    def is_enabled(self, name: str) -> bool: ...
    def set_enabled(self, name: str, enabled: bool) -> None: ...


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


class SLOGuard:
    """Sliding-window p99s of TTFT and ITL, and the rollback rule over them."""

    def __init__(
        self, config: SLOGuardConfig, tiers: TierSwitch, metrics: KVTierMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tiers = tiers
        self.metrics = metrics
        self.clock = clock
        self._budgets = {"ttft": config.ttft_p99_s, "itl": config.itl_p99_s}
        self._samples: dict[str, deque[tuple[float, float]]] = {s: deque() for s in SIGNALS}
        self.p99s: dict[str, float | None] = dict.fromkeys(SIGNALS)
        """The last p99 of each signal over the window (None: no sample in it)."""
        self.over_since: float | None = None
        """When a p99 went over its budget and stayed there (None: all under)."""
        self.disabled: list[tuple[str, float]] = []
        """(tier, when) the guard disabled, oldest first."""
        self.rollbacks = 0
        self._next_check = 0.0
        self._last_restore = -math.inf

    def observe_ttft(self, seconds: float) -> None:
        """One request's time to first token."""
        self._samples["ttft"].append((self.clock(), seconds))

    def observe_itl(self, seconds: float) -> None:
        """One inter-token latency of a request in decode."""
        self._samples["itl"].append((self.clock(), seconds))

    def check(self) -> None:
        """Update the p99s and apply the rule: act once a budget is exceeded for `sustain_s`,
        restore a tier after `cooldown_s` under budget. Cheap when called more often than
        `CHECK_INTERVAL_S`."""
        now = self.clock()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        over = self._update(now)
        self.metrics.set("slo_over_budget", 1.0 if over else 0.0)
        if not over:
            self.over_since = None
            self._maybe_restore(now)
            return
        if self.over_since is None:
            self.over_since = now
        if now - self.over_since >= self.config.sustain_s:
            self._act(now, over)

    def _update(self, now: float) -> list[str]:
        """Drop samples older than the window, recompute the p99s; the signals over budget."""
        horizon = now - self.config.window_s
        over: list[str] = []
        for signal, samples in self._samples.items():
            while samples and samples[0][0] < horizon:
                samples.popleft()
            self.p99s[signal] = p99([v for _, v in samples]) if samples else None
            budget, seen = self._budgets[signal], self.p99s[signal]
            if budget is not None and seen is not None and seen > budget:
                over.append(signal)
        return over

    def _act(self, now: float, over: list[str]) -> None:
        seen = ", ".join(f"{s} p99 {self.p99s[s]:.3f} s > budget {self._budgets[s]} s" for s in over)
        sustained = now - (self.over_since or now)
        self.over_since = None
        for samples in self._samples.values():
            samples.clear()
        if self.config.action == "alert":
            self.metrics.inc("slo_alerts", 1)
            log.warning("kvtier SLO guard: %s for %.1f s (alert only)", seen, sustained)
            return
        enabled = [n for n in self.tiers.tier_names() if self.tiers.is_enabled(n)]
        if not enabled:
            log.warning("kvtier SLO guard: %s for %.1f s; no secondary tier left to disable",
                        seen, sustained)
            return
        tier = enabled[-1]
        self.tiers.set_enabled(tier, False)
        self.disabled.append((tier, now))
        self.rollbacks += 1
        self.metrics.inc("slo_rollbacks", 1)
        log.warning("kvtier SLO guard: %s for %.1f s; disabled tier %r (keeps its data)",
                    seen, sustained, tier)

    def _maybe_restore(self, now: float) -> None:
        if not self.disabled:
            return
        tier, when = self.disabled[-1]
        if now - max(when, self._last_restore) < self.config.cooldown_s:
            return
        self.disabled.pop()
        self._last_restore = now
        if not self.tiers.is_enabled(tier):
            self.tiers.set_enabled(tier, True)
            log.warning("kvtier SLO guard: under budget, %.0f s after disabling it; enabled tier %r",
                        now - when, tier)

    def forget(self, tier: str) -> None:
        """An operator switched `tier` by hand: the guard no longer restores it."""
        self.disabled = [(n, t) for n, t in self.disabled if n != tier]

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot: settings, p99s seen, whether over budget, tiers disabled."""
        now = self.clock()
        return {
            "config": asdict(self.config),
            "p99_s": dict(self.p99s),
            "samples": {s: len(v) for s, v in self._samples.items()},
            "over_budget_for_s": None if self.over_since is None else now - self.over_since,
            "disabled": [{"tier": n, "for_s": now - t} for n, t in self.disabled],
            "rollbacks": self.rollbacks,
        }
