"""Load or recompute (`load_policy`): per request, from the speeds measured now.

`always` (the default) loads every chunk a secondary tier holds. `auto` promotes the run of chunks
a lookup found in the secondary tiers only as far as loading it comes back sooner than recomputing
it: of the run's lengths k whose expected load pays against their expected recompute
(`kvtier.policies.load_rule`, the rule `kvtier plan`'s verdict applies too), the one that saves
the most; none such, none (the chunks the host tier holds before the run
are always loaded: they are cheap). A run cut short is recomputed and counted: the request's split
gives its tokens as "recomputed_by_choice", and `recomputed_by_choice_tokens` counts them by the
tier that held them when the request finishes.

Measured, with `always` too (each estimate decayed: a sample weighs `DECAY` times the one after it):
- each secondary tier's loads: its promotion jobs, seconds from submission to completion by bytes
  (the manager's `load_timer`), fit as a fixed cost per job plus bytes / throughput (`LinearCost`);
- the host tier's loads: the workers' host → device copy seconds per job (`CopyReport.seconds`);
- the engine's prefill rate: a step's time, from its plan (`Planner.step`) to the first of the
  workers' report of it (`copies_done`) or the next step, fit as a fixed cost per step plus its
  prompt tokens / rate (`LinearCost` again). Recomputing a prefix costs only the tokens' part: the
  request's step runs either way for the tokens after it, so its fixed cost is no price of the
  prefix. (Taken as tokens over seconds, the fixed cost was spread over a step's tokens: the
  fewer they were, the dearer a recomputed token looked, and a tier slower than recomputing was
  still loaded.) Steps all of one size leave the two apart unknown: their average rate is taken.
They are the gauges `load_fixed_seconds`, `load_bytes_per_second` (by tier, "host" included) and
`prefill_tokens_per_second` (the marginal rate). What is not measured yet (no prefill rate, a tier
never loaded from) counts as free: the run is loaded, and measured.

A tier judged slower than recomputing sees no loads, so its recovery would go unseen: it is probed,
its whole run loaded anyway, on the `probe_every`-th candidate run since its last load or on the
first one `probe_interval_s` after it (`load_probes`; defaults `PROBE_EVERY`, `PROBE_INTERVAL_S`).
A probe that comes back sooner than recomputing restarts the tier's estimate from that job: a
recovered tier is used again at once. The other way round, a load the fit said would pay that came
back later than recomputing sets a floor: until the tier's next job ends, no load from it is
expected sooner than that one took. A tier that turned slow is so judged from its first slow job,
not only once the decayed fast jobs before it were outweighed (each of those slow jobs a request
waiting the full delay); the fit itself keeps its sizes. (Restarting the fit from that one job
instead, tried first, took a short job's fixed latency as a cost per byte: on an obj tier 0.3 s
away, one 2-chunk job made a 32-chunk load look 16 times dearer, and it was recomputed at 0.82 s
where loading took 0.47 s.)

A request waits for its promotion only so long (`patience`, `GiveUps`): at most its recompute time, and
sooner, after `PATIENCE_SEEN` times the tier's usual time until the scheduler sees a load end, or
`PATIENCE_FLOOR` of the recompute time, whichever is longer. Past it the request gives up (the
planner's `lookup`, a stream's next batch): the chunks are recomputed by choice, counted in
`load_give_ups`, and the promotion ends in the background, measured. A give-up is evidence: until
the tier's next job ends, no load from it is expected sooner than recomputing. A tier's first load
(nothing measured) is waited for whatever it takes; a probe's request waits for nothing (its load
is a measurement only).

Scheduler thread only; nothing here blocks.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.config import AUTO
from kvtier.engine.request_state import RequestState
from kvtier.format.chunks import HOST
from kvtier.manager import PrefixLookup, TieringManager
from kvtier.policies.load_rule import load_pays

DECAY = 0.8
"""Each sample weighs this much less than the next: an estimate follows the last few jobs or steps."""
PROBE_EVERY = 5
"""A tier judged slow is loaded from anyway on this candidate run since its last load (a probe's
request waits for nothing, so a probe costs the tier's bandwidth and a few host rows, not TTFT)."""
PROBE_INTERVAL_S = 10.0
"""... or on its first candidate run this long after its last load."""
PATIENCE_SEEN = 3.0
"""A request waits for a promotion this many times the tier's usual time until a load is seen."""
PATIENCE_FLOOR = 0.1
"""... or this share of the recompute time, whichever is longer (never past the recompute time)."""


@dataclass
class LinearCost:
    """seconds ≈ fixed + size * per_unit, a least-squares fit over samples weighted `DECAY`^age
    (age: how many samples came after). Sizes all alike leave the two parts apart unknown: the
    cost is then taken as proportional to the size."""

    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def add(self, size: float, seconds: float) -> None:
        d = DECAY
        self._w, self._x, self._y = self._w * d + 1, self._x * d + size, self._y * d + seconds
        self._xx, self._xy = self._xx * d + size * size, self._xy * d + size * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit of size), both >= 0; None before the first sample."""
        w, x, y, xx, xy = self._w, self._x, self._y, self._xx, self._xy
        if not w:
            return None
        spread = w * xx - x * x
        if spread <= 1e-9 * w * xx:
            return (0.0, y / x) if x else (y / w, 0.0)
        per_unit = (w * xy - x * y) / spread
        if per_unit < 0:
            return y / w, 0.0
        fixed = (y - per_unit * x) / w
        return (fixed, per_unit) if fixed >= 0 else (0.0, xy / xx)

    def mean_rate(self) -> float | None:
        """The samples' sizes over their seconds (weighted alike); None without seconds."""
        return self._x / self._y if self._y > 0 else None

    def seconds(self, size: float) -> float:
        """The expected seconds of a job of `size` (0 before the first sample)."""
        fit = self.fit()
        return 0.0 if fit is None else fit[0] + fit[1] * size


class LoadChoice:
    """The measurements of one engine and the `auto` decision (see the module docstring)."""

    def __init__(self, policy: str, manager: TieringManager, chunk_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Built once by the planner; takes the manager's `load_timer`."""
        self.auto = policy == AUTO
        self.metrics = manager.metrics
        self.row_bytes = manager.row_bytes
        self.chunk_tokens = chunk_tokens
        self.clock = clock
        self.costs = {name: LinearCost() for name in (HOST, *manager.tiers)}
        self.prefill = LinearCost()
        self._step: tuple[float, int] | None = None
        now = clock()
        self._skipped = dict.fromkeys(manager.tiers, 0)
        self._last_load = dict.fromkeys(manager.tiers, now)
        self._probing: set[str] = set()
        self._floor: dict[str, float] = {}
        self._seen: dict[str, float] = {}
        """Each tier's usual seconds from a load's submission until the scheduler saw it end."""
        self.probed = False
        """The last `choose` started a probe: its request waits for nothing."""
        self.probe_every, self.probe_interval_s = PROBE_EVERY, PROBE_INTERVAL_S
        manager.load_timer = self.tier_loaded

    # -- measurements --------------------------------------------------------------------------

    def tier_loaded(self, tier: str, size: int, seconds: float, seen: float | None = None) -> None:
        """A promotion job of `size` bytes from `tier` took `seconds` in the tier process; the
        scheduler saw it end `seen` seconds after it was submitted (None: as `seconds`)."""
        seen = seconds if seen is None else seen
        last = self._seen.get(tier)
        self._seen[tier] = seen if last is None else DECAY * last + (1 - DECAY) * seen
        rate = self.prefill_rate()
        recompute = size / self.row_bytes * self.chunk_tokens / rate if rate else None
        if tier in self._probing:
            self._probing.discard(tier)
            if recompute is not None and load_pays(seconds, recompute):
                self.costs[tier] = LinearCost()
        self._floor.pop(tier, None)
        if recompute is not None and not load_pays(seconds, recompute) \
                and load_pays(self.costs[tier].seconds(size), recompute):
            self._floor[tier] = seconds
        self._sample(tier, size, seconds)

    def patience(self, tiers: set[str], tokens: int) -> float | None:
        """How long a request may wait for the promotion of `tokens` prompt tokens from `tiers`
        (see the module docstring); None: it waits whatever it takes (`always`, nothing measured
        yet, or a tier's first load)."""
        rate = self.prefill_rate()
        if not self.auto or not rate or not tiers or any(self.costs[t].fit() is None for t in tiers):
            return None
        recompute = tokens / rate
        return min(recompute, max(PATIENCE_SEEN * max(self._seen.get(t, 0.0) for t in tiers),
                                  PATIENCE_FLOOR * recompute))

    def gave_up(self, tier: str) -> None:
        """A request stopped waiting for a promotion from `tier`: until the tier's next job ends,
        no load from it is expected sooner than recomputing."""
        self._floor[tier] = math.inf
        self.metrics.inc("load_give_ups", 1, tier)

    def expected(self, tier: str, size: int) -> float:
        """The expected seconds of a job of `size` bytes from `tier`: the fit, or the floor a slow
        job set until the tier's next job ends."""
        return max(self.costs[tier].seconds(size), self._floor.get(tier, 0.0))

    def host_loaded(self, chunks: int, seconds: float) -> None:
        """The workers copied `chunks` host rows to the device in `seconds` (one load job)."""
        self._sample(HOST, chunks * self.row_bytes, seconds)

    def step_planned(self, prompt_tokens: int) -> None:
        """A step is planned that computes `prompt_tokens` prompt tokens (it ends the last one)."""
        self.step_ended()
        if prompt_tokens:
            self._step = (self.clock(), prompt_tokens)

    def step_ended(self) -> None:
        """The workers reported the last planned step (or another was planned)."""
        if self._step is None:
            return
        (start, tokens), self._step = self._step, None
        seconds = self.clock() - start
        if seconds > 0:
            self.prefill.add(tokens, seconds)
            rate = self.prefill_rate()
            if rate is not None:
                self.metrics.set("prefill_tokens_per_second", rate)

    def prefill_rate(self) -> float | None:
        """Prompt tokens per second a step's time grows by with its tokens (recent steps; their
        average rate where the fit has no positive slope or no fixed cost to set apart); None
        before the first measured step."""
        fit = self.prefill.fit()
        if fit is None:
            return None
        fixed, per_token = fit
        return 1 / per_token if fixed > 0 and per_token > 0 else self.prefill.mean_rate()

    def _sample(self, tier: str, size: int, seconds: float) -> None:
        cost = self.costs[tier]
        cost.add(size, seconds)
        fit = cost.fit()
        if fit is not None:
            self.metrics.set("load_fixed_seconds", fit[0], tier)
            self.metrics.set("load_bytes_per_second", 1 / fit[1] if fit[1] else 0.0, tier)

    # -- the decision --------------------------------------------------------------------------

    def choose(self, by_choice: Counter[str], sources: Sequence[str]) -> int:
        """How many leading chunks of a run found in the secondary tiers (chunk i held by tier
        `sources[i]`) to promote; `by_choice` (the request's, cleared first) gets the tokens of
        the others by tier. Called once per promoting lookup, before anything is promoted."""
        by_choice.clear()
        self.probed = False
        rate = self.prefill_rate()
        if not self.auto or not rate or not sources:
            return len(sources)
        best, saving = 0, 0.0
        counts: Counter[str] = Counter()
        for k, tier in enumerate(sources, 1):
            counts[tier] += 1
            load = max(self.expected(t, c * self.row_bytes) for t, c in counts.items())
            load += self.costs[HOST].seconds(k * self.row_bytes)
            recompute = k * self.chunk_tokens / rate
            if load_pays(load, recompute) and recompute - load > saving:
                best, saving = k, recompute - load
        if best == len(sources) or self._probe(set(sources[best:])):
            self._loaded(set(sources))
            return len(sources)
        self._loaded(set(sources[:best]))
        for tier in sources[best:]:
            by_choice[tier] += self.chunk_tokens
        return best

    def _probe(self, slow: set[str]) -> bool:
        """Whether a candidate run the `slow` tiers were judged too slow for is loaded anyway."""
        now = self.clock()
        for tier in slow:
            self._skipped[tier] += 1
        due = {t for t in slow
               if self._skipped[t] >= self.probe_every or now - self._last_load[t] >= self.probe_interval_s}
        for tier in due:
            self.metrics.inc("load_probes", 1, tier)
        self._probing |= due
        self.probed = bool(due)
        return bool(due)

    def _loaded(self, tiers: set[str]) -> None:
        now = self.clock()
        for tier in tiers:
            self._skipped[tier], self._last_load[tier] = 0, now


class GiveUps:
    """The bounded waits of one engine's requests for their promotions.

    A lookup whose chunks are being promoted answers "ask again" each step until they are in the
    host tier. Under `auto`, from the step the promotion started (or, for a request waiting on
    another request's promotion, the step it first found the chunks pending), past its `patience`
    the request takes what the host tier holds before the promoted chunks and recomputes the rest:
    their tokens are "recomputed_by_choice" by the tier that was loading them, the give-up is
    counted and taken as evidence, and the promotion goes on in the background, its chunks not
    held for the request and its time measured. A request that gave up is offered nothing past
    that point again, so its split never counts a chunk both ways."""

    def __init__(self, manager: TieringManager, choice: LoadChoice, chunk_tokens: int) -> None:
        """Waits are timed on the choice's clock."""
        self.manager = manager
        self.choice = choice
        self.chunk_tokens = chunk_tokens

    def cap(self, state: RequestState, start: int, keys: list[bytes]) -> list[bytes]:
        """The keys a lookup from chunk `start` may still offer: none past a give-up."""
        if state.gave_up_at is None:
            return keys
        return keys[: max(state.gave_up_at - start, 0)]

    def check(self, state: RequestState, start: int, keys: Sequence[bytes], found: PrefixLookup
              ) -> PrefixLookup:
        """`found`, a pending answer for `keys` (from chunk `start`), or, once the request waited
        past its patience (a probe's at once), what the host tier holds before the pending chunks,
        the rest given up."""
        now = self.choice.clock()
        if found.promoting and self.choice.probed:
            return self._give_up(state, start, keys, found.ready, count=False)
        if state.waiting_since is None:
            tiers = self._pending_tiers(state, start, keys, found.ready)
            if not tiers:  # a tier's answer, or a store to the host tier, is awaited: not bounded here
                return found
            state.waiting_since = now
            state.patience = self.choice.patience(set(tiers.values()), len(tiers) * self.chunk_tokens)
        if state.patience is None or now - state.waiting_since <= state.patience:
            return found
        return self._give_up(state, start, keys, found.ready, count=True)

    def _pending_tiers(self, state: RequestState, start: int, keys: Sequence[bytes], ready: int
                       ) -> dict[int, str]:
        """The tier loading each chunk after the `ready` ones, by chunk index: promoted for this
        request, or by another request's promotion in flight."""
        out: dict[int, str] = {}
        for i in range(ready, len(keys)):
            tier = state.promoted_from.get(start + i) or self.manager.promoting_tier(keys[i])
            if tier is None:
                break
            if tier != HOST:
                out[start + i] = tier
        return out

    def _give_up(self, state: RequestState, start: int, keys: Sequence[bytes], ready: int,
                 count: bool) -> PrefixLookup:
        tiers = self._pending_tiers(state, start, keys, ready)
        for tier in tiers.values():
            state.hits.by_choice[tier] += self.chunk_tokens
        if count:
            for tier in set(tiers.values()):
                self.choice.gave_up(tier)
        # Only this request's own promotion is let go: another request's holds stay its own.
        own = [i - start for i in state.promoted_from if start + ready <= i < start + len(keys)]
        self.manager.release([keys[i] for i in own])
        state.gave_up_at = start + ready
        state.streamed = range(0)
        return PrefixLookup(ready, pending=False)

    def part_patience(self, sources: Sequence[str]) -> float | None:
        """How long a stream may wait for the promotion of a batch of chunks from `sources`."""
        return self.choice.patience(set(sources) - {HOST}, len(sources) * self.chunk_tokens)

    def stream_gave_up(self, state: RequestState | None, sources: Sequence[str]) -> None:
        """A stream stopped waiting for its next batch: the rest of its chunks (from `sources`,
        counted loaded when the request was allocated) are recomputed by choice."""
        for tier in set(sources) - {HOST}:
            self.choice.gave_up(tier)
        if state is None:
            return
        for source in sources:
            state.hits.loaded[source] -= self.chunk_tokens
            state.hits.by_choice[source] += self.chunk_tokens
