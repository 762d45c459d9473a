"""The campaign's load: the reference conversations replayed on the kvtier engine, round after
round, at concurrency, every reply compared with the reference.

Each conversation sends its turns in order (the reference's prompts, token for token), one request
in flight per conversation and at most `max_concurrency` in the engine; after its last turn it
starts again at turn 1 (the next round) while `keep_going()` says so. A request is `ok` when its
reply's token ids are the reference's; one not finished `hang_s` after it was added is aborted and
counted `hung`; one the engine finishes with an error is `failed`. With `load_tiers`, the n-th
request may load its prefix only from the secondary tiers `load_tiers[n % len(load_tiers)]` (the
host tier always may). Driven by `engine.step()` of an in-process engine, on the calling thread
(the engine's scheduler thread).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.chaos.reference import Reference


@dataclass
class Outcome:
    """One request: where it sits in the workload, its timings (seconds) and its verdict."""

    conversation: int
    turn: int
    round: int
    start: float
    ttft: float | None = None
    end: float | None = None
    ok: bool = False
    hung: bool = False
    failed: str | None = None
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class _Live:
    outcome: Outcome
    expected: tuple[int, ...]
    produced: int = 0


def drive(engine: Any, ref: Reference, max_concurrency: int, keep_going: Callable[[int], bool],
          hang_s: float, stop: Callable[[], bool] = lambda: False,
          on_finish: Callable[[Outcome], None] | None = None,
          load_tiers: Sequence[Sequence[str]] = ()) -> list[Outcome]:
    """Serve the conversations until none may go on; `keep_going(round)` is asked when a
    conversation finished round `round` (0-based); once `stop()` holds no request is added (those
    in flight finish). Every outcome, in finishing order."""
    from vllm import SamplingParams

    ready: deque[tuple[int, int, int]] = deque((c, 0, 0) for c in range(len(ref.turns)))
    live: dict[str, _Live] = {}
    done: list[Outcome] = []
    ids = 0
    while ready or live:
        if stop():
            ready.clear()
        while ready and len(live) < max_concurrency:
            conv, turn, rnd = ready.popleft()
            expected = ref.turns[conv][turn]
            ids += 1
            req_id = f"chaos-{conv}-{rnd}-{turn}-{ids}"
            extra = None if not load_tiers else {"kv_transfer_params": {"kvtier": {
                "load_tiers": list(load_tiers[(ids - 1) % len(load_tiers)])}}}
            params = SamplingParams(temperature=0.0, max_tokens=len(expected.reply), ignore_eos=True,
                                    extra_args=extra)
            outcome = Outcome(conv, turn, rnd, time.monotonic())
            engine.add_request(req_id, {"prompt_token_ids": list(expected.prompt)}, params)
            live[req_id] = _Live(outcome, expected.reply)
        outputs = engine.step()
        now = time.monotonic()
        finished: list[tuple[str, Any]] = []
        for out in outputs:
            job = live.get(out.request_id)
            if job is None:
                continue
            produced = len(out.outputs[0].token_ids) if out.outputs else 0
            if produced > job.produced and job.outcome.ttft is None:
                job.outcome.ttft = now - job.outcome.start
            job.produced = produced
            if out.finished:
                finished.append((out.request_id, out))
        for req_id, job in list(live.items()):
            if now - job.outcome.start > hang_s and all(r != req_id for r, _ in finished):
                engine.abort_request([req_id])
                job.outcome.hung = True
                finished.append((req_id, None))
        for req_id, out in finished:
            job = live.pop(req_id)
            o = job.outcome
            o.end = now
            if out is not None:
                reply = tuple(out.outputs[0].token_ids) if out.outputs else ()
                o.ok = reply == job.expected
                reason = out.outputs[0].finish_reason if out.outputs else None
                if reason not in ("length", "stop"):
                    o.failed = f"finish_reason {reason}"
                split = ((out.kv_transfer_params or {}).get("kvtier") or {}).get("tokens") or {}
                o.tokens = {k: int(v) for k, v in split.items()}
            done.append(o)
            if on_finish is not None:
                on_finish(o)
            nxt = o.turn + 1
            if nxt < len(ref.turns[o.conversation]):
                ready.append((o.conversation, nxt, o.round))
            elif keep_going(o.round):
                ready.append((o.conversation, 0, o.round + 1))
    return done
