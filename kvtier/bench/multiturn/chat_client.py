"""The client of an OpenAI-compatible endpoint: streamed chat completions, timed, on asyncio.

`ChatClient.chat` sends one `/v1/chat/completions` request with `stream: true` (and usage in the
last chunk) and returns a `RequestRecord` with the time to the first content chunk, the gaps
between later content chunks (inter-token latency) and the token counts the server reports, plus
the reply text. Greedy sampling; `ignore_eos` (a vLLM extension, on by default) makes every reply
exactly `output_tokens` long.

`LoopLag` measures how late the event loop wakes up (a 5 ms ticker): when the client is the
bottleneck this grows, and TTFT/ITL would include client time. The benchmark reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx

from kvtier.bench.multiturn.conversation import Message
from kvtier.bench.multiturn.summary import RequestRecord, summary


class ChatClient:
    """One connection pool to `base_url` for up to `max_concurrency` requests in flight."""

    def __init__(self, base_url: str, model: str, output_tokens: int, max_concurrency: int, *,
                 ignore_eos: bool = True, timeout_s: float = 600.0, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.model = model
        self.output_tokens = output_tokens
        self.ignore_eos = ignore_eos
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits, headers=headers,
                                       timeout=httpx.Timeout(timeout_s, connect=30.0),
                                       transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    def body(self, messages: list[Message]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True,
                                "stream_options": {"include_usage": True},
                                "max_tokens": self.output_tokens, "temperature": 0.0}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def chat(self, conversation: int, turn: int,
                   messages: list[Message]) -> tuple[RequestRecord, str]:
        """Serve one turn; a failure is a record with `error` set (and an empty reply)."""
        start = time.perf_counter()
        record = RequestRecord(conversation, turn, start, start, 0.0, 0, 0)
        parts: list[str] = []
        last: float | None = None
        try:
            async with self._http.stream("POST", "/v1/chat/completions",
                                         json=self.body(messages)) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:500]
                    raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    now = time.perf_counter()
                    usage = chunk.get("usage")
                    if usage:
                        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        record.output_tokens = int(usage.get("completion_tokens") or 0)
                    text = "".join((c.get("delta") or {}).get("content") or ""
                                   for c in chunk.get("choices") or ())
                    if not text:
                        continue
                    parts.append(text)
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
            if last is None:
                raise RuntimeError("the stream ended without any content")
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            record.error = f"{type(e).__name__}: {e}"
        record.end_s = time.perf_counter()
        return record, "".join(parts)


class LoopLag:
    """Samples event-loop wake-up lateness every `interval_s` while running (`start`/`stop`)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(time.perf_counter() - before - self.interval_s, 0.0))

    async def stop(self) -> dict[str, float]:
        """Stop sampling; lateness p50/p95/p99/mean and max, in milliseconds."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        out = {k: v * 1000 for k, v in summary(self.samples).items()}
        out["max"] = max(self.samples, default=0.0) * 1000
        return out
