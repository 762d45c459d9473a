"""The endpoint side without a server: the streamed-chat parser (TTFT, ITL, usage, errors) over a
mock transport, and the conversation scheduler (FIFO order, the concurrency bound, replies
carried, client overhead reported)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from kvtier.bench.multiturn import chat_client, endpoint_run
from kvtier.bench.multiturn.chat_client import ChatClient, LoopLag
from kvtier.bench.multiturn.conversation import WorkloadSpec
from kvtier.bench.multiturn.summary import RequestRecord


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _delta(text: str | None, role: str | None = None) -> dict:
    delta = {"content": text} if text is not None else {}
    if role:
        delta["role"] = role
    return {"choices": [{"index": 0, "delta": delta}]}


def test_stream_gives_ttft_itl_usage_and_reply() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = _sse([_delta("", role="assistant"), _delta("The"), _delta(" council"), _delta(" met."),
                     {"choices": [], "usage": {"prompt_tokens": 321, "completion_tokens": 3}}])
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> tuple[RequestRecord, str]:
        client = ChatClient("http://bench", "smol", 3, 2, transport=httpx.MockTransport(handler))
        try:
            return await client.chat(4, 2, [{"role": "user", "content": "hi"}])
        finally:
            await client.aclose()

    record, reply = asyncio.run(go())
    assert reply == "The council met." and not record.error
    assert (record.conversation, record.turn, record.prompt_tokens, record.output_tokens) == (4, 2, 321, 3)
    assert len(record.itl_s) == 2 and 0 < record.ttft_s <= record.end_s - record.start_s
    assert seen[0]["stream"] is True and seen[0]["max_tokens"] == 3 and seen[0]["ignore_eos"] is True
    assert seen[0]["stream_options"] == {"include_usage": True} and seen[0]["temperature"] == 0.0


@pytest.mark.parametrize(("status", "body", "error"), [
    (500, b"engine dead", "HTTP 500: engine dead"),
    (200, b"data: [DONE]\n\n", "without any content"),
])
def test_failed_requests_are_records_with_an_error(status: int, body: bytes, error: str) -> None:
    async def go() -> tuple[RequestRecord, str]:
        client = ChatClient("http://bench", "smol", 3, 1,
                            transport=httpx.MockTransport(lambda r: httpx.Response(status, content=body)))
        try:
            return await client.chat(0, 1, [{"role": "user", "content": "hi"}])
        finally:
            await client.aclose()

    record, reply = asyncio.run(go())
    assert error in record.error and reply == ""


class FakeClient:
    """Answers after a short sleep; records order, concurrency and the messages it got."""

    def __init__(self, *args, **kwargs) -> None:
        self.inflight = 0
        self.most = 0
        self.calls: list[tuple[int, int, list[dict]]] = []

    async def chat(self, conversation: int, turn: int, messages: list[dict]):
        self.calls.append((conversation, turn, messages))
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        await asyncio.sleep(0.03 * (1 + conversation % 3))  # longer than building a message
        self.inflight -= 1
        now = 1.0
        record = RequestRecord(conversation, turn, now, now, 0.001, 10, 2)
        return record, f"reply {conversation}.{turn}"

    async def aclose(self) -> None:
        pass


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    from kvtier.tools.models import prepare_smollm2

    return AutoTokenizer.from_pretrained(str(prepare_smollm2(quiet=True)))


def test_scheduler_fifo_concurrency_and_replies(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    fake = FakeClient()
    monkeypatch.setattr(endpoint_run, "ChatClient", lambda *a, **k: fake)
    spec = WorkloadSpec(200, 64, 3, 5, 2, 2)
    done: list[RequestRecord] = []
    records, client = endpoint_run.run_endpoint_point("http://x", "m", spec, tokenizer, "s", done.append)
    assert len(records) == len(done) == 15 and fake.most == 2
    # FIFO: the first two conversations go first, every turn 1 before any turn 3, and each
    # conversation's turns in order (message building runs in threads, so calls may swap a little)
    order = [(c, t) for c, t, _ in fake.calls]
    assert set(order[:2]) == {(0, 1), (1, 1)}
    assert max(order.index((c, 1)) for c in range(5)) < min(order.index((c, 3)) for c in range(5))
    for conv in range(5):
        assert [t for c, t in order if c == conv] == [1, 2, 3]
    last = next(m for c, t, m in fake.calls if (c, t) == (3, 3))
    assert [m["content"] for m in last if m["role"] == "assistant"] == ["reply 3.1", "reply 3.2"]
    assert set(client) == {"loop_lag_ms", "prep_ms", "cpu_fraction"}
    assert client["prep_ms"]["p50"] > 0 and client["loop_lag_ms"]["max"] >= 0


def test_loop_lag_sees_a_blocked_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]  # the sampler's clock, moved by hand
    monkeypatch.setattr(chat_client, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    async def go() -> list[float]:
        lag = LoopLag(0.001)
        lag.start()
        while len(lag.samples) < 2:  # the ticker sleeps again, its clock read
            await asyncio.sleep(0)
        now[0] += 0.05  # the loop is blocked for 50 ms of its clock: the ticker wakes ~50 ms late
        seen = len(lag.samples)
        while len(lag.samples) == seen:
            await asyncio.sleep(0)
        stats = await lag.stop()
        assert stats["max"] == pytest.approx(49.0)
        return lag.samples

    samples = asyncio.run(go())
    assert samples[:-1] == [0.0] * (len(samples) - 1) and samples[-1] == pytest.approx(0.049)
