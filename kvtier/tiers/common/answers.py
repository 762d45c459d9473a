"""The lookup-answer cache: what a tier answered about keys, kept `ttl_s` seconds, and which keys are
being asked.

Three askers share it: the tier-process proxy (`kvtier.tiers.process`, on the scheduler thread), the
redis tier (its lookup thread answers) and the p2p lookup (its lookup thread asks the peers). A key
is in one of three states: answered (HIT or MISS, until the answer is `ttl_s` old), being asked (an
answer is on its way: RETRY, and not asked again), or unknown (RETRY, and asked). An answer may name
its source (p2p: the peer holding the key).

Not thread-safe: each owner calls it from one thread, or under its own lock (which it also needs for
the conditions its threads wait on).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.tiers.base import LookupResult


class AnswerCache:
    """Answers by key, oldest first, and the keys being asked."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._answers: OrderedDict[bytes, tuple[LookupResult, float, str | None]] = OrderedDict()
        self._asking: set[bytes] = set()

    def lookup(
        self, keys: Sequence[bytes], now: float, *, ask: bool = True
    ) -> tuple[list[LookupResult], list[bytes]]:
        """One result per key: its answer, else RETRY. Also returns the unknown keys to ask, now
        marked as being asked (none when not `ask`)."""
        self.expire(now)
        out: list[LookupResult] = []
        new: list[bytes] = []
        for key in keys:
            answer = self._answers.get(key)
            if answer is not None:
                out.append(answer[0])
                continue
            out.append(LookupResult.RETRY)
            if ask and key not in self._asking:
                self._asking.add(key)
                new.append(key)
        return out, new

    def get(self, key: bytes) -> tuple[LookupResult, str | None] | None:
        """The answer about `key` and its source, or None when there is none (expired ones go at
        the next `lookup` or `expire`)."""
        answer = self._answers.get(key)
        return None if answer is None else (answer[0], answer[2])

    def put(self, key: bytes, result: LookupResult, now: float, source: str | None = None) -> None:
        """Remember an answer given at `now` (a lookup reply, or what a job proved)."""
        self._answers[key] = (result, now, source)
        self._answers.move_to_end(key)

    def drop(self, key: bytes) -> None:
        """Forget the answer about `key` (a job proved it wrong or stale): the next lookup asks."""
        self._answers.pop(key, None)

    def unask(self, key: bytes) -> None:
        """The question about `key` got its reply: a later lookup may ask again."""
        self._asking.discard(key)

    def expire(self, now: float) -> None:
        """Drop the answers `ttl_s` old or older."""
        while self._answers:
            key, (_, t, _) = next(iter(self._answers.items()))
            if now - t < self.ttl_s:
                break
            del self._answers[key]

    def forget(self) -> None:
        """Drop every answer (what the tier held may be gone); questions in flight stay asked."""
        self._answers.clear()

    def reset(self) -> None:
        """Drop every answer and question (the replies to questions in flight will never come)."""
        self._answers.clear()
        self._asking.clear()
