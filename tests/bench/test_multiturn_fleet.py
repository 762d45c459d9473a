"""`kvtier bench multiturn --endpoints`: the routing rules over fake chat clients (which instance
serves each turn), and the fleet-wide split of a served point from each instance's `/metrics`
delta (scrapes answered from canned counters), without a server."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.multiturn import configs, endpoint_run, sweep
from kvtier.bench.multiturn.cli import add_parser
from kvtier.bench.multiturn.conversation import WorkloadSpec
from kvtier.bench.multiturn.fleet import FleetClient, Router
from kvtier.bench.multiturn.summary import RequestRecord


class Instance:
    """A fake chat client for one URL: answers at once, remembers the (conversation, turn) pairs."""

    def __init__(self, url: str, *args: Any, **kwargs: Any) -> None:
        self.url = url
        self.served: list[tuple[int, int]] = []

    async def chat(self, conversation: int, turn: int, messages: list[dict]) -> tuple[RequestRecord, str]:
        self.served.append((conversation, turn))
        await asyncio.sleep(0.001 * (1 + conversation % 3))
        return RequestRecord(conversation, turn, 1.0, 1.5, 0.1, 100 * turn, 2), f"reply {conversation}.{turn}"

    async def aclose(self) -> None:
        pass


@pytest.fixture
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kvtier.tools.models import prepare_smollm2

    return AutoTokenizer.from_pretrained(str(prepare_smollm2(quiet=True)))


def test_round_robin_moves_each_turn_to_the_next_instance() -> None:
    router = Router("round-robin", 3)
    assert [router.pick(0, t) for t in (1, 2, 3, 4)] == [0, 1, 2, 0]
    assert [router.pick(c, 1) for c in (0, 1, 2, 3, 4)] == [0, 1, 2, 0, 1]  # first turns spread
    assert [router.pick(5, t) for t in (1, 2, 3)] == [2, 0, 1]


def test_prefix_affinity_keeps_a_conversation_on_one_instance() -> None:
    router = Router("prefix-affinity", 3)
    assert [router.pick(c, t) for c, t in ((0, 1), (4, 1), (0, 2), (5, 3), (4, 6), (3, 2))] \
        == [0, 1, 0, 2, 1, 0]


def test_unknown_rules_and_mismatched_fleets_are_errors() -> None:
    with pytest.raises(ValueError, match="known: round-robin, prefix-affinity"):
        Router("random", 2)
    with pytest.raises(ValueError, match="at least one instance"):
        Router("round-robin", 0)
    with pytest.raises(ValueError, match="3 clients for a router over 2"):
        FleetClient([Instance("a"), Instance("b"), Instance("c")], Router("round-robin", 2))


def _drive(monkeypatch: pytest.MonkeyPatch, tokenizer: Any, route: str) -> tuple[list[Instance],
                                                                                  list[RequestRecord]]:
    made: list[Instance] = []

    def make(url: str, *args: Any, **kwargs: Any) -> Instance:
        made.append(Instance(url))
        return made[-1]

    monkeypatch.setattr(endpoint_run, "ChatClient", make)
    spec = WorkloadSpec(160, 64, 3, 4, 2, 2)
    records, _ = endpoint_run.run_endpoint_point(["http://a", "http://b"], "m", spec, tokenizer, "f",
                                                 route=route)
    return made, records


def test_a_fleet_run_routes_every_turn_and_marks_its_instance(
        monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> None:
    made, records = _drive(monkeypatch, tokenizer, "round-robin")
    assert [m.url for m in made] == ["http://a", "http://b"]
    assert len(made[0].served) == len(made[1].served) == 6  # 12 turns, evenly spread
    # every turn after the first is on the instance that did not serve the turn before it
    assert all((r.conversation, r.turn - 1) in made[1 - r.instance].served for r in records if r.turn > 1)
    for record in records:
        assert (record.conversation, record.turn) in made[record.instance].served

    made, records = _drive(monkeypatch, tokenizer, "prefix-affinity")
    assert sorted(made[0].served) == [(c, t) for c in (0, 2) for t in (1, 2, 3)]
    assert sorted(made[1].served) == [(c, t) for c in (1, 3) for t in (1, 2, 3)]
    assert all(r.instance == r.conversation % 2 for r in records)


def _metrics(device: int, host: int, fs: int, recomputed: int, preempted: int) -> str:
    lines = [f'kvtier_prompt_tokens_total{{source="{s}"}} {v}'
             for s, v in (("device", device), ("host", host), ("fs", fs), ("recomputed", recomputed))]
    return "\n".join([*lines, f"vllm:num_preemptions_total {preempted}", ""])


def test_the_fleet_split_sums_each_instance_delta(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Instance a served 300 prompt tokens (100 device, 200 fs), b 500 (400 host, 100 recomputed);
    each scrape after the run reads the counters moved by that much past their starting values."""
    scrapes = {"http://a/metrics": [_metrics(10, 0, 0, 50, 1), _metrics(110, 0, 200, 50, 1)],
               "http://b/metrics": [_metrics(0, 7, 0, 0, 0), _metrics(0, 407, 0, 100, 2)]}
    monkeypatch.setattr(sweep, "http_get", lambda url, timeout=10.0: scrapes[url].pop(0))

    def serve(urls: Any, model: str, spec: WorkloadSpec, tokenizer: Any, tag: str, *args: Any,
              on_step: Any = None, route: str = "", **kwargs: Any) -> tuple[list[RequestRecord], dict]:
        if tag == "warm-up":
            return [], {}
        assert list(urls) == ["http://a", "http://b"] and route == "prefix-affinity"
        records = [RequestRecord(0, 1, 0.0, 1.0, 0.2, 300, 2, instance=0),
                   RequestRecord(1, 1, 0.0, 2.0, 0.6, 500, 2, instance=1)]
        on_step(0, records)
        return records, {"cpu_fraction": 0.1}

    monkeypatch.setattr(sweep, "run_endpoint_point", serve)
    ctx = configs.BenchContext(1 << 20, 40, 400, 80, tmp_path)
    plan = sweep.Plan(WorkloadSpec(160, 64, 1, 2, 1, 2), (2,), ["fleet"], "endpoint", None, "m", None,
                      32, 1 << 20, 1024, ctx, endpoints=("http://a/", "http://b"),
                      route="prefix-affinity")
    point: dict[str, Any] = {}
    sweep._served_point(plan, sweep.schedule((2,), ["fleet"], 1)[0], ["http://a", "http://b"],
                        sweep.Hooks(), point.update, True)
    assert point["tokens"] == {"device": 100, "host": 400, "fs": 200, "recomputed": 100}
    assert point["tokens_sum_ok"] and point["prompt_tokens"] == 800 and point["reused_tokens"] == 700
    assert point["preemptions"] == 2 and point["route"] == "prefix-affinity"
    a, b = point["instances"]
    assert (a["url"], a["requests"], a["prompt_tokens"]) == ("http://a", 1, 300)
    assert a["tokens"] == {"device": 100, "host": 0, "fs": 200, "recomputed": 0}
    assert b["tokens"] == {"device": 0, "host": 400, "fs": 0, "recomputed": 100}
    assert b["ttft_s"]["p50"] == pytest.approx(0.6)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "multiturn", *argv])


def test_the_cli_takes_a_fleet_and_a_rule(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("--endpoints", "http://a:1, http://b:2", "--route", "prefix-affinity")
    assert args.endpoints == ("http://a:1", "http://b:2") and args.route == "prefix-affinity"
    assert _parse("--endpoint", "http://a:1").route == "round-robin"
    for bad in (["--endpoints", "http://a:1"], ["--endpoint", "x", "--endpoints", "a,b"],
                ["--endpoints", "a,b", "--route", "random"]):
        with pytest.raises(SystemExit):
            _parse(*bad)
    assert "at least two comma-separated URLs" in capsys.readouterr().err
