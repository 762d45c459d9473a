"""The host replay where its own hits move the recorded timing, and the cliffs `kvtier plan` reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.trace.plan import plan
from kvtier.trace.records import Trace, read_traces
from kvtier.trace.replay import host_hit_ratios, host_hits, schedule_s
from tests.trace.traces import write_trace

A, B, C, D, E = range(1, 6)
QUIET = [  # recomputed: each step comes 2 ms after its lookup (the trace's `schedule_s`)
    {"t": 0.0, "lookup": 0.0, "st": [[0.002, 2]], "keys": [A, B], "prompt": 33,
     "src": {"device": 0, "recomputed": 33}},
    {"t": 1.0, "lookup": 0.0, "st": [[0.002, 2]], "keys": [C, D], "prompt": 33,
     "src": {"device": 0, "recomputed": 33}},
]
LOADED_AB = {"t": 2.0, "lookup": 0.0, "st": [[3.0, 3]], "keys": [A, B, E], "prompt": 49,
             "src": {"device": 0, "host": 32, "recomputed": 17}}
"""Recorded loading A, B from the host: its prefill waited for the copy until t=5."""


def _trace(tmp_path: Path, records: list[dict]) -> Trace:
    return read_traces([write_trace(tmp_path / "t.jsonl", records)])


def test_a_request_that_misses_the_host_is_scheduled_at_its_lookup(tmp_path: Path) -> None:
    loaded_cd = {"t": 3.0, "lookup": 0.0, "st": [[0.5, 2]], "keys": [C, D], "prompt": 33,
                 "src": {"device": 0, "host": 32, "recomputed": 1}}
    trace = _trace(tmp_path, [*QUIET, LOADED_AB, loaded_cd])
    assert schedule_s(trace) == pytest.approx(0.002)
    # 4 rows hold A-D: both loads hit as recorded. With 2, C and D pushed A and B out: the request
    # at t=2 finds nothing, so the engine recomputes it at once (t=2.002, not t=5 after a load),
    # and its rows for A, B evict C, D before the lookup at t=3, which misses too. The replay that
    # kept the recorded step at t=5 served C, D at t=3 (2 of 9 references).
    assert host_hits(trace, [4]) == [[0, 0, 2, 2]]
    assert host_hits(trace, [2]) == [[0, 0, 0, 0]]
    assert host_hit_ratios(trace, [2, 4]) == [0.0, 4 / 9]


def test_the_moved_step_comes_after_the_lookups_of_its_scheduler_step(tmp_path: Path) -> None:
    same_step = {"t": 2.001, "lookup": 0.0, "st": [[0.5, 2]], "keys": [C, D], "prompt": 33,
                 "src": {"device": 0, "host": 32, "recomputed": 1}}
    trace = _trace(tmp_path, [*QUIET, LOADED_AB, same_step])
    # Looked up 1 ms after the request at t=2, within `schedule_s`: the engine reserves that
    # step's rows after both lookups, so C, D are found (and pinned: A, B get no row).
    assert host_hits(trace, [2]) == [[0, 0, 0, 2]]


def test_nothing_moves_without_steps_or_for_a_load_from_another_tier(tmp_path: Path) -> None:
    later_cd = {"t": 3.0, "lookup": 0.0, "keys": [C, D], "prompt": 33, "ttft": 0.5,
                "src": {"device": 0, "host": 32, "recomputed": 1}}
    old = [{k: v for k, v in r.items() if k != "st"} | {"ttft": 0.002} for r in [*QUIET, LOADED_AB]]
    old[2]["ttft"] = 3.0
    trace = _trace(tmp_path, [*old, later_cd])
    assert schedule_s(trace) is None
    assert host_hits(trace, [2]) == [[0, 0, 0, 2]]  # the store stays at t=5, after t=3's lookup
    from_fs = {**LOADED_AB, "src": {"device": 0, "fs": 32, "recomputed": 17}}
    trace = _trace(tmp_path, [*QUIET, from_fs, {**later_cd, "st": [[0.5, 2]]}])
    # A, B still come from the fs tier at a smaller host: the prefill still waits for that copy.
    assert host_hits(trace, [2]) == [[0, 0, 0, 2]]


def _cycle(conversations: int = 4, chunks: int = 3, rounds: int = 4) -> list[dict]:
    """Conversations asked in turn, one request a second, each naming its own `chunks` chunks:
    the first round recomputed, later rounds recorded loading everything from the host."""
    records = []
    for i in range(conversations * rounds):
        conv, first = i % conversations, i < conversations
        keys = [100 * (conv + 1) + k for k in range(chunks)]
        src = {"device": 0, "recomputed": 16 * chunks} if first else {"device": 0, "host": 16 * chunks}
        records.append({"t": float(i), "lookup": 0.0, "st": [[0.001 if first else 0.5, chunks]],
                        "keys": keys, "prompt": 16 * chunks, "src": src})
    return records


def test_plan_reports_a_cliff_around_the_working_set(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", _cycle())
    trace = read_traces([path])
    # 12 chunks cycled: 12 rows serve every later round (36 of 48 references), 9 or fewer none (10
    # and 11 some: a store never evicts the chunks it names, which breaks the cycle's order).
    assert host_hit_ratios(trace, [3, 9, 12, 20]) == [0.0, 0.0, 0.75, 0.75]
    report = plan(trace, host_bytes_per_s=1e9, at=[3000, 9000, 20_000]).report
    assert report["cliff_chunks"] == 3
    far, below, above = report["predict"]
    # 9 rows: every later request misses what it recorded loading, and 3 rows more or less (one
    # request's chunks: 6 to 12) spans 0% to 75%: a cliff.
    assert (below["host_hit_ratio"], below["changed_requests"]) == (0.0, 12)
    assert below["range_bytes"] == [6000, 12_000]
    assert below["hit_ratio_range"] == [0.0, 0.75]
    assert below["cliff"] is True
    # Far below it the curve is flat (0% from 0 to 6 rows), and well above nothing changes: no cliff.
    assert (far["hit_ratio_range"], far["changed_requests"], far["cliff"]) == ([0.0, 0.0], 12, False)
    assert (above["hit_ratio_range"], above["changed_requests"], above["cliff"]) == ([0.75, 0.75], 0, False)
    assert main(["plan", str(path), "--host-gib-s", "1", "--at", "9000,20000"]) == 0
    out = capsys.readouterr().out
    assert out.count("on a cliff: 0.0% to 75.0% between 6000 and 12000 bytes") == 1


def test_recommendation_says_when_it_sits_on_a_cliff_of_the_lru_curve(tmp_path: Path) -> None:
    report = plan(read_traces([write_trace(tmp_path / "t.jsonl", _cycle())]),
                  host_bytes_per_s=1e9).report
    rec = report["recommend"]
    # LRU over the cycle: 0 below 12 chunks, 75% from 12: the 90% capture point is the cliff's top.
    assert rec["cpu_bytes_to_use"] == 12_000
    assert rec["cpu_cliff"] == {"range_bytes": [9000, 15_000], "hit_ratio_range": [0.0, 0.75],
                                "cliff": True}


def test_a_trace_without_timings_pins_nothing_for_ever(tmp_path: Path) -> None:
    records = [{"t": float(i), "keys": keys, "prompt": 16 * len(keys), "src": {"device": 0}}
               for i, keys in enumerate([[A], [A], [B, C], [B, C]])]
    trace = _trace(tmp_path, records)
    # Lookup and step at the same time (no `lookup`, `ttft` or `st`): the second request's hit on
    # A is over at once, so B and C push A out and the last request finds both. (A pin released
    # before the lookup that took it held A for ever: C found no row, and the last request only B.)
    assert host_hits(trace, [2]) == [[0, 1, 0, 2]]


@pytest.mark.parametrize(("end", "last_hits"), [(2.6, 2), (10.0, 1)])
def test_a_request_refreshes_its_prefix_when_it_ends_not_when_it_loads(
    tmp_path: Path, end: float, last_hits: int
) -> None:
    records = [
        {"t": 0.0, "end": 0.2, "lookup": 0.0, "st": [[0.1, 2]], "keys": [A, B], "prompt": 33,
         "src": {"device": 0, "recomputed": 33}},
        {"t": 1.0, "end": 1.2, "lookup": 0.0, "st": [[0.1, 1]], "keys": [C], "prompt": 17,
         "src": {"device": 0, "recomputed": 17}},
        {"t": 2.0, "end": end, "lookup": 0.0, "st": [[0.5, 2]], "keys": [A, B], "prompt": 33,
         "src": {"device": 0, "host": 32, "recomputed": 1}},
        {"t": 3.0, "end": 3.2, "lookup": 0.0, "st": [[0.1, 1]], "keys": [D], "prompt": 17,
         "src": {"device": 0, "recomputed": 17}},
        {"t": 4.0, "end": 4.5, "lookup": 0.0, "st": [[0.1, 2]], "keys": [A, B], "prompt": 33,
         "src": {"device": 0, "host": 32, "recomputed": 1}},
    ]
    trace = _trace(tmp_path, records)
    assert trace.finish.tolist() == pytest.approx([0.2, 0.2, end - 2.0, 0.2, 0.5])
    # 3 rows: after the first request A is the most recent, B before it, then C. The third request
    # loads A and B, which refreshes nothing. Ended at 2.6 it makes B, then A the most recent, so D
    # (t=3.1) evicts C and the last request finds A and B; still running at 3.1 (end 10), it has
    # refreshed nothing yet, so D evicts B, the least recent, and the last request finds A alone.
    assert host_hits(trace, [3]) == [[0, 0, 2, 0, last_hits]]


def test_a_host_load_unpins_at_the_end_of_its_lookups_step(tmp_path: Path) -> None:
    records = [  # each request that loads nothing steps 1 ms after its lookup: `schedule_s`
        {"t": 0.0, "end": 0.5, "lookup": 0.0, "st": [[0.001, 2]], "keys": [A, B], "prompt": 33,
         "src": {"device": 0, "recomputed": 33}},
        {"t": 1.0, "end": 1.5, "lookup": 0.0, "st": [[0.001, 1]], "keys": [C], "prompt": 17,
         "src": {"device": 0, "recomputed": 17}},
        {"t": 2.0, "end": 2.5, "lookup": 0.0, "st": [[0.1, 3]], "keys": [A, B, D], "prompt": 49,
         "src": {"device": 0, "host": 32, "recomputed": 17}},
        {"t": 2.049, "end": 2.3, "lookup": 0.0, "st": [[0.001, 1]], "keys": [E], "prompt": 17,
         "src": {"device": 0, "recomputed": 17}},
        {"t": 2.06, "end": 2.4, "lookup": 0.0, "st": [[0.001, 1]], "keys": [C], "prompt": 17,
         "src": {"device": 0, "recomputed": 17}},
    ]
    trace = _trace(tmp_path, records)
    # 3 rows: B, A, C from least to most recent. The request at t=2 loads A and B from the host;
    # the copy is over at the end of its lookup's step, and its prefill waits for a later step
    # (t=2.1). The store of E at t=2.05 comes in between: A and B are no longer pinned, so it
    # evicts B and the lookup at t=2.06 finds C. (Held until t=2.1, A and B made it evict C.)
    assert host_hits(trace, [3]) == [[0, 0, 2, 0, 1]]
