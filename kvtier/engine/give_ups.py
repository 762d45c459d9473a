"""How long a request waits for a promotion, and what giving up on it does (`load_policy: auto`).

A lookup whose chunks are being promoted answers "ask again" each step until they are in the host
tier. Under `auto` that wait has a bound, the `patience` of `kvtier.engine.load_choice`: from the
step the promotion started (or, for a request waiting on another request's promotion, from the
step it first found the chunks pending), past its patience the request gives up. It takes what the
host tier holds before the promoted chunks and recomputes the rest: their tokens are
"recomputed_by_choice" by the tier that was loading them, the tier's give-up is counted and taken
as evidence, and the promotion goes on in the background, its chunks not held for the request (a
later request may find them) and its time measured. A request that gave up is offered nothing past
that point again, so its split never counts a chunk both ways. A probe's request gives up at once:
its load is a measurement only.

Scheduler thread only; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.engine.load_choice import LoadChoice
from kvtier.engine.request_state import RequestState
from kvtier.format.chunks import HOST
from kvtier.manager import PrefixLookup, TieringManager


class GiveUps:
    """The bounded waits of one engine's requests for their promotions."""

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
        self.manager.release(keys[ready:])
        state.gave_up_at = start + ready
        state.streamed = range(0)
        state.waiting_since = None
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
