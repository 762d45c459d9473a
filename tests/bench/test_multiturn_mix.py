"""Mixed traffic and a concurrency ramp (`workload`): the single-use share is exact and
deterministic, single-use prompts share no chunk with any other prompt, a ramp's steps run at their
own concurrency with the caches' conversations carried over, and points report the two kinds apart
with end-to-end latency."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvtier.bench.multiturn import endpoint_run
from kvtier.bench.multiturn.conversation import WorkloadSpec
from kvtier.bench.multiturn.summary import RequestRecord, point_summary
from kvtier.bench.multiturn.workload import Mix, Ramp, SingleUse, Workload

BLOCK = 64


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvtier.tools.models import prepare_smollm2

    return AutoTokenizer.from_pretrained(str(prepare_smollm2(quiet=True)))


def _serve_one_at_a_time(workload: Workload) -> list[tuple[bool, list[int]]]:
    """Every item in order at concurrency 1: (single-use?, prompt ids)."""
    out = []
    while (conv := workload.take()) is not None:
        conv.ask()
        out.append((isinstance(conv, SingleUse), conv.prompt_ids()))
        conv.answer("Fine.")
        workload.put_back(conv)
    assert workload.exhausted
    return out


@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.75])
def test_mix_ratio_is_exact_and_deterministic(tokenizer, ratio: float) -> None:
    spec = WorkloadSpec(200, 64, 3, 4, 1, 4)
    served = _serve_one_at_a_time(Workload(spec, tokenizer, "m", Mix(ratio, 120)))
    singles = sum(single for single, _ in served)
    assert len(served) - singles == 12  # every conversation turn
    assert singles == round(12 * ratio / (1 - ratio))
    assert singles / len(served) == pytest.approx(ratio, abs=0.05)
    # single-use requests are spread between the turns, not bunched at the end
    kinds = [single for single, _ in served]
    assert any(kinds[: len(kinds) // 2]) and not all(kinds[: len(kinds) // 2])
    again = _serve_one_at_a_time(Workload(spec, tokenizer, "m", Mix(ratio, 120)))
    assert again == served


def test_single_use_prompts_never_repeat(tokenizer) -> None:
    spec = WorkloadSpec(200, 64, 3, 4, 1, 4)
    served = _serve_one_at_a_time(Workload(spec, tokenizer, "u", Mix(0.5, 150)))
    singles = [ids for single, ids in served if single]
    turns = [ids for single, ids in served if not single]
    assert len(singles) == 12 and all(len(ids) == 150 for ids in singles)
    # the first chunk decides every chunk key (they chain): no single-use first chunk is shared
    firsts = [tuple(ids[:BLOCK]) for ids in singles]
    assert len(set(firsts)) == len(firsts)
    assert not set(firsts) & {tuple(ids[:BLOCK]) for ids in turns}
    # while the conversations do share their first chunk (the system prompt) and extend their turns
    assert len({tuple(ids[:BLOCK]) for ids in turns}) == 1
    other_run = _serve_one_at_a_time(Workload(spec, tokenizer, "u2", Mix(0.5, 150)))
    assert not set(firsts) & {tuple(ids[:BLOCK]) for single, ids in other_run if single}


def test_bad_mix_and_ramp_name_the_flag() -> None:
    for mix, flag in ((Mix(1.0), "--mix 1.0"), (Mix(-0.1), "--mix -0.1"), (Mix(0.5, 0), "--mix-tokens 0")):
        with pytest.raises(ValueError, match=flag):
            mix.check()
    for ramp, flag in ((Ramp((1, 0), 4), "--ramp 1,0"), (Ramp((1, 2)), "--ramp-step"),
                       (Ramp((1, 2), 4, 1.0), "--ramp-step"), (Ramp((1,), 0), "--ramp-step-requests 0"),
                       (Ramp((1,), None, 0.0), "--ramp-step-s 0.0")):
        with pytest.raises(ValueError, match=flag):
            ramp.check()


class FakeClient:
    """Answers after a short sleep; records what it was asked and how many were in flight."""

    def __init__(self) -> None:
        self.inflight = 0
        self.calls: list[tuple[int, int, int, str]] = []  # (conversation, turn, in flight, system)

    async def chat(self, conversation: int, turn: int, messages: list[dict]):
        self.inflight += 1
        self.calls.append((conversation, turn, self.inflight, messages[0]["content"][:20]))
        await asyncio.sleep(0.01)
        self.inflight -= 1
        record = RequestRecord(conversation, turn, 1.0, 1.5, 0.1, 10, 2)
        return record, "ok"

    async def aclose(self) -> None:
        pass


def test_ramp_steps_by_requests_with_a_drain_between(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    fake = FakeClient()
    monkeypatch.setattr(endpoint_run, "ChatClient", lambda *a, **k: fake)
    spec = WorkloadSpec(200, 64, 2, 3, 4, 2)
    steps: list[tuple[int, int]] = []
    records, _ = endpoint_run.run_endpoint_point(
        "http://x", "m", spec, tokenizer, "r", ramp=Ramp((1, 2, 4), step_requests=8),
        mix=Mix(0.5, 120), on_step=lambda step, done: steps.append((step, len(done))))
    assert steps == [(0, 8), (1, 8), (2, 8)]
    assert [r.step for r in records] == [0] * 8 + [1] * 8 + [2] * 8
    in_flight = [c[2] for c in fake.calls]
    assert max(in_flight[:8]) == 1 and max(in_flight[8:16]) <= 2 and max(in_flight[16:]) <= 4
    assert max(in_flight[16:]) > 2  # the last step did run wider than the one before
    # endless: 3 conversations of 2 turns cannot fill 12 turns; new conversations replaced them
    turns = [(c, t) for c, t, _, system in fake.calls if not system.startswith("Request")]
    assert len(turns) == 12 and max(c for c, _ in turns) >= 5
    assert sum(r.single_use for r in records) == 12


def test_ramp_steps_by_time(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    fake = FakeClient()
    monkeypatch.setattr(endpoint_run, "ChatClient", lambda *a, **k: fake)
    steps: list[int] = []
    records, _ = endpoint_run.run_endpoint_point(
        "http://x", "m", WorkloadSpec(200, 64, 2, 2, 2, 2), tokenizer, "t",
        ramp=Ramp((1, 2), step_s=0.3), on_step=lambda step, done: steps.append(len(done)))
    assert len(steps) == 2 and all(n >= 2 for n in steps)
    assert {r.step for r in records} == {0, 1} and len(records) == sum(steps)


def test_point_reports_e2e_and_the_two_kinds_apart() -> None:
    def rec(single: bool, start: float, end: float, ttft: float, prompt: int) -> RequestRecord:
        r = RequestRecord(0, 1, start, end, ttft, prompt, 2, [0.1])
        r.single_use = single
        return r

    records = [rec(False, 0.0, 2.0, 0.5, 400), rec(False, 0.0, 4.0, 1.0, 600),
               rec(True, 1.0, 2.0, 0.2, 100), rec(True, 1.0, 1.5, 0.1, 100)]
    split = {"device": 200, "host": 500, "fs": 0, "recomputed": 500}
    point = point_summary("host", 2, records, split)
    assert point["e2e_s"]["p50"] == pytest.approx(1.5) and point["e2e_s"]["p99"] == pytest.approx(3.94)
    single = point["single_use"]
    assert single["requests"] == 2 and single["prompt_tokens"] == 200
    assert single["ttft_s"]["p50"] == pytest.approx(0.15) and single["turn_ttft_s"]["p50"] == 0.75
    assert single["conversation_tokens"] == {"device": 200, "host": 500, "fs": 0, "recomputed": 300}
    assert single["conversation_host_hit"] == 0.5
    assert "single_use" not in point_summary("host", 2, records[:2], split)
    assert math.isnan(point_summary("host", 2, records[2:], split)["single_use"]["conversation_host_hit"])
