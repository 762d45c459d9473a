"""One point of the workload against an OpenAI-compatible endpoint, or a fleet of them.

Scheduling (the same in the in-process runner): the conversations wait in one FIFO queue, in
order; `max_concurrency` workers each take the conversation at the head, ask its next turn, stream
the answer, append the reply, and put the conversation back at the tail if it has turns left. So
every conversation is active from the start, and a conversation's next turn comes after about
`conversations` other turns: its prefix must survive that many requests in some cache. With a
`Mix` the workers also take single-use requests as they fall due, and with a `Ramp` the run is a
sequence of steps, each at its own concurrency and ended by a drain (`workload` says how). With
several endpoints the same workload goes to a fleet, each request to the instance a routing rule
picks (`fleet`).

The client's own cost is measured and returned with the records: the time to build each user
message (tokenizer and chat template, run in a worker thread so it does not stall the event
loop), the event loop's lateness, and the client process's CPU time over the wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.bench.multiturn.chat_client import ChatClient, LoopLag
from kvtier.bench.multiturn.conversation import Conversation, Tokenizer, WorkloadSpec
from kvtier.bench.multiturn.fleet import Chat, FleetClient, Router, check_route
from kvtier.bench.multiturn.summary import RequestRecord, summary
from kvtier.bench.multiturn.workload import Mix, Ramp, SingleUse, Workload

OnRequest = Callable[[RequestRecord], None]
OnStep = Callable[[int, list[RequestRecord]], None]


@dataclass
class _Step:
    """One step of the run: its concurrency, and when it stops starting requests (None: never)."""

    concurrency: int
    requests: int | None = None
    deadline_s: float | None = None
    started: int = 0

    def over(self) -> bool:
        return ((self.requests is not None and self.started >= self.requests)
                or (self.deadline_s is not None and time.perf_counter() >= self.deadline_s))

    def wait_s(self) -> float | None:
        return None if self.deadline_s is None else max(self.deadline_s - time.perf_counter(), 0.0)


async def _serve_step(workload: Workload, client: Chat, step: _Step, index: int,
                      records: list[RequestRecord], prep: list[float], on_request: OnRequest | None) -> None:
    """Serve items at `step.concurrency` until the step is over or the workload exhausted, then
    drain: return when every request the step started has finished."""
    changed = asyncio.Condition()

    async def next_item() -> Conversation | None:
        async with changed:
            while not step.over() and not workload.exhausted:
                item = workload.take()
                if item is not None:
                    step.started += 1
                    return item
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), step.wait_s())
            return None

    async def worker() -> None:
        while (conv := await next_item()) is not None:
            started = time.perf_counter()
            messages = await asyncio.to_thread(conv.ask)
            prep.append(time.perf_counter() - started)
            record, reply = await client.chat(conv.index, conv.turn, messages)
            record.single_use, record.step = isinstance(conv, SingleUse), index
            conv.answer(reply)
            records.append(record)
            if on_request is not None:
                on_request(record)
            async with changed:
                workload.put_back(conv)
                changed.notify_all()

    await asyncio.gather(*(worker() for _ in range(step.concurrency)))


async def _drive(workload: Workload, client: Chat, ramp: Ramp | None, on_request: OnRequest | None,
                 on_step: OnStep | None) -> tuple[list[RequestRecord], list[float]]:
    records: list[RequestRecord] = []
    prep: list[float] = []
    if ramp is None:
        steps = [_Step(workload.spec.max_concurrency)]
    else:
        steps = [_Step(level, ramp.step_requests) for level in ramp.levels]
    for index, step in enumerate(steps):
        if ramp is not None and ramp.step_s is not None:
            step.deadline_s = time.perf_counter() + ramp.step_s
        done = len(records)
        await _serve_step(workload, client, step, index, records, prep, on_request)
        if on_step is not None:
            on_step(index, records[done:])
    return records, prep


async def _run(base_urls: Sequence[str], route: str, model: str, workload: Workload,
               ramp: Ramp | None, on_request: OnRequest | None, on_step: OnStep | None,
               ignore_eos: bool, api_key: str | None) -> tuple[list[RequestRecord], dict[str, Any]]:
    spec = workload.spec
    most = max(ramp.levels) if ramp is not None else spec.max_concurrency
    clients = [ChatClient(url, model, spec.output_tokens, most, ignore_eos=ignore_eos, api_key=api_key)
               for url in base_urls]
    client: Chat = clients[0] if len(clients) == 1 else FleetClient(clients, Router(route, len(clients)))
    lag = LoopLag()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    lag.start()
    try:
        records, prep = await _drive(workload, client, ramp, on_request, on_step)
    finally:
        lag_ms = await lag.stop()
        await client.aclose()
    wall = time.perf_counter() - wall0
    prep_ms = {k: v * 1000 for k, v in summary(prep).items()}
    return records, {"loop_lag_ms": lag_ms, "prep_ms": prep_ms,
                     "cpu_fraction": (time.process_time() - cpu0) / wall if wall else 0.0}


def run_endpoint_point(base_url: str | Sequence[str], model: str, spec: WorkloadSpec,
                       tokenizer: Tokenizer, tag: str, on_request: OnRequest | None = None, *,
                       ignore_eos: bool = True, api_key: str | None = None, mix: Mix | None = None,
                       ramp: Ramp | None = None, on_step: OnStep | None = None,
                       route: str = "round-robin") -> tuple[list[RequestRecord], dict[str, Any]]:
    """Serve the whole workload (with `ramp`: every step, an endless workload); the request
    records (each with its `step`, whether it was `single_use`, and the `instance` that served it)
    and the client's overhead (`client`). `on_step(step, records)` runs after each step has
    drained. Several URLs are a fleet: each request goes to the instance `route` picks
    (`fleet.Router`)."""
    if ramp is not None:
        ramp.check()
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not urls:
        raise ValueError("no endpoint to drive")
    check_route(route)
    workload = Workload(spec, tokenizer, tag, mix, endless=ramp is not None)
    return asyncio.run(_run(urls, route, model, workload, ramp, on_request, on_step,
                            ignore_eos, api_key))
