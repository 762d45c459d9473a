"""One point of the workload against an OpenAI-compatible endpoint.

Scheduling (the same in the in-process runner): the conversations wait in one FIFO queue, in
order; `max_concurrency` workers each take the conversation at the head, ask its next turn, stream
the answer, append the reply, and put the conversation back at the tail if it has turns left. So
every conversation is active from the start, and a conversation's next turn comes after about
`conversations` other turns: its prefix must survive that many requests in some cache.

The client's own cost is measured and returned with the records: the time to build each user
message (tokenizer and chat template, run in a worker thread so it does not stall the event
loop), the event loop's lateness, and the client process's CPU time over the wall time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvtier.bench.multiturn.client import ChatClient, LoopLag
from kvtier.bench.multiturn.conversation import Conversation, Tokenizer, WorkloadSpec
from kvtier.bench.multiturn.stats import RequestRecord, summary

OnRequest = Callable[[RequestRecord], None]


async def _drive(conversations: list[Conversation], client: ChatClient, concurrency: int,
                 on_request: OnRequest | None) -> tuple[list[RequestRecord], list[float]]:
    ready: asyncio.Queue[Conversation | None] = asyncio.Queue()
    for conv in conversations:
        ready.put_nowait(conv)
    records: list[RequestRecord] = []
    prep: list[float] = []
    left = len(conversations)
    workers = min(concurrency, len(conversations))

    async def worker() -> None:
        nonlocal left
        while (conv := await ready.get()) is not None:
            started = time.perf_counter()
            messages = await asyncio.to_thread(conv.ask)
            prep.append(time.perf_counter() - started)
            record, reply = await client.chat(conv.index, conv.turn, messages)
            conv.answer(reply)
            records.append(record)
            if on_request is not None:
                on_request(record)
            if not conv.finished:
                ready.put_nowait(conv)
                continue
            left -= 1
            if left == 0:
                for _ in range(workers):
                    ready.put_nowait(None)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return records, prep


async def _run(base_url: str, model: str, spec: WorkloadSpec, tokenizer: Tokenizer, tag: str,
               on_request: OnRequest | None, ignore_eos: bool,
               api_key: str | None) -> tuple[list[RequestRecord], dict[str, Any]]:
    conversations = [Conversation(i, spec, tokenizer, tag) for i in range(spec.conversations)]
    client = ChatClient(base_url, model, spec.output_tokens, spec.max_concurrency,
                        ignore_eos=ignore_eos, api_key=api_key)
    lag = LoopLag()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    lag.start()
    try:
        records, prep = await _drive(conversations, client, spec.max_concurrency, on_request)
    finally:
        lag_ms = await lag.stop()
        await client.aclose()
    wall = time.perf_counter() - wall0
    prep_ms = {k: v * 1000 for k, v in summary(prep).items()}
    return records, {"loop_lag_ms": lag_ms, "prep_ms": prep_ms,
                     "cpu_fraction": (time.process_time() - cpu0) / wall if wall else 0.0}


def run_endpoint_point(base_url: str, model: str, spec: WorkloadSpec, tokenizer: Tokenizer, tag: str,
                       on_request: OnRequest | None = None, *, ignore_eos: bool = True,
                       api_key: str | None = None) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Serve the whole workload; the request records and the client's overhead (`client`)."""
    return asyncio.run(_run(base_url, model, spec, tokenizer, tag, on_request, ignore_eos, api_key))
