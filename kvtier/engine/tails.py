"""Stores that outlive their request: chunks a finished request computed but could not store yet.

A device → host store finds no room when every host row is pinned (cascades and loads in flight);
its chunks are tried again at the request's next step. A request that finishes first would lose
them for good (nothing else holds their blocks), and a later turn of the conversation recomputes
them. Instead, the scheduler keeps such a request's chunks as a tail: vLLM keeps its blocks
(`request_finished` answers True), the tail's stores are tried at every step, and once they are all
planned, or after `TAIL_WAIT_S`, the request is released: the worker reports it "finished sending"
when the stores planned for it have ended, and vLLM frees its blocks.

Only chunks that were refused for lack of room wait, and a finished request's unfull chunk
(`kvtier.engine.unfull`, stored once its full chunks are); chunks admission refused, and requests
that skip stores, never do. Runs on the scheduler thread; never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.engine.copies import ChunkCopy
from kvtier.engine.request_state import RequestState

TAIL_WAIT_S = 2.0
"""How long a finished request's blocks are kept for stores that find no host room."""

PlanStore = Callable[[RequestState, int], "ChunkCopy | None"]


@dataclass
class _Tail:
    state: RequestState
    computed: int
    """Tokens whose KV the request's blocks hold."""
    deadline: float


class Tails:
    """The finished requests whose blocks vLLM keeps for kvtier's stores, by request id."""

    def __init__(self, chunk_tokens: int, wait_s: float = TAIL_WAIT_S) -> None:
        self._chunk_tokens = chunk_tokens
        self._wait_s = wait_s
        self._tails: dict[str, _Tail] = {}

    def hold(self, state: RequestState, computed: int) -> bool:
        """Keep `state`'s unstored chunks (of the first `computed` tokens) as a tail; True when
        there are some, i.e. when vLLM must keep the request's blocks until `releases` names it."""
        if state.options.skip_store or not self._unstored(state, computed):
            return False
        self._tails[state.request.request_id] = _Tail(state, computed, time.monotonic() + self._wait_s)
        return True

    def held(self, req_id: str) -> bool:
        return req_id in self._tails

    def step(self, plan_store: PlanStore) -> tuple[list[ChunkCopy], list[str]]:
        """This step's stores for the tails, and the requests released: all their chunks are now
        planned, or their time is up (the chunks left are lost, as without tails)."""
        stores: list[ChunkCopy] = []
        released: list[str] = []
        now = time.monotonic()
        for req_id, tail in list(self._tails.items()):
            store = plan_store(tail.state, tail.computed)
            if store is not None:
                stores.append(store)
            if not self._unstored(tail.state, tail.computed) or now >= tail.deadline:
                del self._tails[req_id]
                released.append(req_id)
        return stores, released

    def _unstored(self, state: RequestState, computed: int) -> bool:
        done = min(computed // self._chunk_tokens, len(state.keys))
        return state.unfull_due is not None or any(c not in state.refused for c in range(state.stored, done))

    def __len__(self) -> int:
        return len(self._tails)
