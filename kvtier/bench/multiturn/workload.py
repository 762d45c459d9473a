"""What the runner serves next: the conversations' turns, mixed single-use prompts, ramp steps.

`Workload` hands out items one at a time (`take`) and gets them back answered (`put_back`):

- the conversations wait in one FIFO queue; a conversation taken is out until its answer comes
  back, then goes to the tail if it has turns left. A finite workload ends when every
  conversation has asked its last turn; an endless one (a ramp) replaces each finished
  conversation by a new one at the tail, so `spec.conversations` stay active.
- `Mix`: single-use requests between the turns. `ratio` is their share of all requests
  (0.5: as many single-use requests as conversation turns), each one turn of `tokens` prompt
  tokens. They are due by count, not by chance: after n conversation turns were taken,
  round(n x ratio / (1 - ratio)) single-use requests have been (at most that total in a finite
  workload), so the order of decisions is the same in every run. A single-use prompt opens with a
  system prompt naming its tag and number, so its first chunk, and with it every chunk (keys
  chain), differs from every other prompt's: it is never reused.
- `Ramp`: the run's concurrency steps through `levels`; each step lasts `step_requests` requests
  started or `step_s` seconds, then drains (no new request until those in flight have finished),
  so each step's latency and hit split are its own while the caches carry over. See
  `endpoint_run`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from kvtier.bench.multiturn.conversation import SYSTEM_PROMPT, Conversation, Tokenizer, WorkloadSpec


@dataclass(frozen=True)
class Mix:
    """Single-use requests: their share of all requests and their prompt length."""

    ratio: float = 0.0
    tokens: int = 256

    def check(self) -> None:
        if not 0.0 <= self.ratio < 1.0:
            raise ValueError(f"--mix {self.ratio}: must be >= 0 and < 1 (the single-use share of requests)")
        if self.tokens < 1:
            raise ValueError(f"--mix-tokens {self.tokens}: must be >= 1")

    @property
    def per_turn(self) -> float:
        """Single-use requests per conversation turn."""
        return self.ratio / (1.0 - self.ratio)

    def due(self, turns: int) -> int:
        """Single-use requests owed once `turns` conversation turns were taken."""
        return math.floor(turns * self.per_turn + 0.5)


@dataclass(frozen=True)
class Ramp:
    """Concurrency levels in order, each held for `step_requests` requests or `step_s` seconds."""

    levels: tuple[int, ...]
    step_requests: int | None = None
    step_s: float | None = None

    def check(self) -> None:
        if not self.levels or min(self.levels) < 1:
            raise ValueError(f"--ramp {','.join(map(str, self.levels))}: concurrency levels >= 1")
        if (self.step_requests is None) == (self.step_s is None):
            raise ValueError("--ramp: give one of --ramp-step-requests and --ramp-step-s")
        if self.step_requests is not None and self.step_requests < 1:
            raise ValueError(f"--ramp-step-requests {self.step_requests}: must be >= 1")
        if self.step_s is not None and not self.step_s > 0:
            raise ValueError(f"--ramp-step-s {self.step_s}: must be > 0")


class SingleUse(Conversation):
    """A one-turn conversation whose prompt shares no chunk with any other (see the module
    docstring)."""


def single_use(index: int, spec: WorkloadSpec, tokenizer: Tokenizer, tag: str, tokens: int) -> SingleUse:
    """Single-use request `index` of the workload tagged `tag`: `tokens` prompt tokens."""
    system = {"role": "system", "content": f"Request {tag}/{index}. {SYSTEM_PROMPT}"}
    one = replace(spec, initial_tokens=tokens, turns=1)
    return SingleUse(index, one, tokenizer, f"{tag}/single", messages=[system])


class Workload:
    """The items of one run, in the order the module docstring gives."""

    def __init__(self, spec: WorkloadSpec, tokenizer: Tokenizer, tag: str, mix: Mix | None = None,
                 endless: bool = False) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.tag = tag
        self.mix = mix or Mix()
        self.mix.check()
        self.endless = endless
        self.ready: deque[Conversation] = deque(
            Conversation(i, spec, tokenizer, tag) for i in range(spec.conversations))
        self.started = spec.conversations
        self.out = 0
        self.turns_taken = 0
        self.singles_taken = 0
        self._singles_total = self.mix.due(spec.conversations * spec.turns)

    def _singles_due(self) -> int:
        due = self.mix.due(self.turns_taken)
        return due if self.endless else min(due, self._singles_total)

    def take(self) -> Conversation | None:
        """The next item (its next turn is to be asked), or None when none is ready now."""
        if self.singles_taken < self._singles_due():
            self.singles_taken += 1
            return single_use(self.singles_taken - 1, self.spec, self.tokenizer, self.tag, self.mix.tokens)
        if not self.ready:
            return None
        self.turns_taken += 1
        self.out += 1
        return self.ready.popleft()

    def put_back(self, conv: Conversation) -> None:
        """`conv` was answered: it rejoins the queue, or a new conversation replaces it (endless)."""
        if isinstance(conv, SingleUse):
            return
        self.out -= 1
        if not conv.finished:
            self.ready.append(conv)
        elif self.endless:
            self.ready.append(Conversation(self.started, self.spec, self.tokenizer, self.tag))
            self.started += 1

    @property
    def exhausted(self) -> bool:
        """Nothing will be ready again (a finite workload served to its end)."""
        return (not self.endless and not self.ready and self.out == 0
                and self.singles_taken >= self._singles_due())
