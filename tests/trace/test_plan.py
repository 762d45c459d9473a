"""`kvtier plan` on traces with known answers, the LRU curve against a brute-force LRU, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.policies.arc import ARCPolicy
from kvtier.trace.mrc import lru_hit_ratios, previous_reference, simulate, stack_distances
from kvtier.trace.plan import plan
from kvtier.trace.records import TraceError, read_traces
from kvtier.trace.replay import host_hit_ratios
from tests.trace.traces import write_trace

A, B, C, D, E, F, G, H, J = range(1, 10)
KNOWN = [  # 16-token chunks of 1000 bytes
    {"t": 0.0, "keys": [A, B, C, D], "prompt": 64, "prio": 50, "src": {"device": 0, "recomputed": 64}},
    {"t": 10.0, "keys": [A, B, E, F], "prompt": 64, "prio": 50, "src": {"device": 32, "recomputed": 32}},
    {"t": 30.0, "keys": [A, B, C, G], "prompt": 64, "prio": 50, "src": {"host": 48, "recomputed": 16}},
    {"t": 40.0, "keys": [H, J], "prompt": 32, "prio": 10, "src": {"recomputed": 32}},
]


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = write_trace(tmp_path_factory.mktemp("known") / "t.jsonl", KNOWN)
    return plan(read_traces([path]), host_bytes_per_s=1e6).report


def test_questions_one_and_two(known: dict) -> None:
    assert known["requests"] == 4
    assert known["prompt_tokens"] == 224
    assert known["chunk_references"] == 14
    assert known["token_sources"] == {"device": 32, "host": 48, "recomputed": 144}
    # A, B reused at t=10; A, B, C at t=30: 5 chunks of 16 tokens out of 224.
    assert known["reusable_token_fraction"] == pytest.approx(80 / 224)
    assert known["requests_with_shared_prefix_fraction"] == 0.5
    top = known["top_shared_prefixes"]
    assert [(p["key"], p["tokens"], p["reuses"], p["saved_tokens"]) for p in top] == [
        (C.to_bytes(8, "big").hex(), 48, 1, 48), (B.to_bytes(8, "big").hex(), 32, 1, 32)]
    # Since creation: 10, 10, 30, 30, 30; between reuses: 10, 10, 20, 20, 30.
    assert known["reuse_time_s"] == pytest.approx(
        {"p50": 30.0, "p95": 30.0, "p99": 30.0})
    gaps = np.array([10, 10, 20, 20, 30])
    assert known["reuse_gap_s"] == pytest.approx(
        dict(zip(("p50", "p95", "p99"), np.percentile(gaps, [50, 95, 99]), strict=True)))


def test_question_three_chunk_sizes(known: dict) -> None:
    rows = {r["blocks_per_chunk"]: r for r in known["chunk_size"]}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32]
    one, two, four = rows[1], rows[2], rows[4]
    # 9 distinct chunks stored, 5 reused; 6 never reused.
    assert (one["bytes_moved"], one["reused_tokens"], one["unneeded_bytes"]) == (14000, 80, 6000)
    assert one["bytes_per_reused_token"] == 175.0
    assert one["load_ms_per_chunk"] == pytest.approx(1.0)
    assert one["host_budget_fraction"] == pytest.approx(14000 / 40 / 1e6)
    # Pairs named by B, D / B, F / B, G / I: B reused twice; D, F, G, I never.
    assert (two["bytes_moved"], two["reused_tokens"], two["unneeded_bytes"]) == (14000, 64, 8000)
    # Fours D, F, G: none reused, so no bytes per reused token.
    assert (four["reused_tokens"], four["bytes_per_reused_token"], four["unneeded_bytes"]) == (0, None, 12000)
    # No whole chunk of 8 blocks; each request stores its 4 (or 2) blocks as an unfull chunk, a
    # whole host row of 8, and none is reused (no prompt goes on from where another ended).
    assert (rows[8]["reused_tokens"], rows[8]["unfull_tokens"], rows[8]["bytes_moved"]) == (0, 0, 32000)
    assert known["recommend"]["blocks_per_chunk"] == 1 and known["recommend"]["chunk_tokens"] == 16


def test_question_four_bypass(known: dict) -> None:
    assert known["never_reused_chunk_fraction"] == pytest.approx(6 / 9)
    freq = {r["min_seen"]: r for r in known["admission"]["frequency"]}
    assert freq[1]["reuse_kept_fraction"] == 1.0
    assert freq[2]["admitted_chunk_fraction"] == pytest.approx(3 / 9)
    assert freq[2]["reuse_kept_fraction"] == pytest.approx(2 / 5)
    assert freq[3]["reuse_kept_fraction"] == 0.0
    prio = {r["min_retention_priority"]: r for r in known["admission"]["priority"]}
    assert prio[50]["admitted_chunk_fraction"] == pytest.approx(7 / 9)
    assert prio[50]["reuse_kept_fraction"] == 1.0
    assert known["recommend"]["admission"] == {"frequency_min_seen": 1, "min_retention_priority": 50}


def test_sizing(known: dict) -> None:
    # Stack distances of A B C D A B E F A B C G H I: the reuses are at 4, 4, 4, 4 and 6.
    lru = dict(known["mrc"]["lru"])
    assert lru[3000] == 0.0
    assert lru[4000] == pytest.approx(4 / 14)
    assert lru[6000] == lru[9000] == pytest.approx(5 / 14)
    assert known["working_set_bytes"] == 9000
    assert known["reachable_hit_ratio"] == pytest.approx(5 / 14)
    assert known["capture_bytes"] == {"90%": 6000, "95%": 6000, "99%": 6000}
    assert dict(known["mrc"]["arc"])[9000] == pytest.approx(5 / 14)
    rec = known["recommend"]
    assert (rec["cpu_bytes_to_use"], rec["max_bytes"]) == (6000, 6000)
    assert rec["cpu_hit_ratio"] == pytest.approx(5 / 14)


def _brute_lru(refs: list[int], size: int) -> float:
    cache: list[int] = []
    hits = 0
    for k in refs:
        if k in cache:
            hits += 1
            cache.remove(k)
        elif len(cache) >= size:
            cache.pop(0)
        cache.append(k)
    return hits / len(refs)


@pytest.mark.parametrize("seed", range(5))
def test_lru_curve_equals_brute_force_lru(seed: int) -> None:
    rng = random.Random(seed)
    refs = [rng.randrange(rng.choice([5, 20, 60])) for _ in range(rng.randrange(50, 400))]
    arr = np.array(refs, dtype=np.uint64)
    prev = previous_reference(arr)
    distances = stack_distances(prev)
    sizes = list(range(len(set(refs)) + 2))
    assert lru_hit_ratios(distances, sizes) == [_brute_lru(refs, s) if s else 0.0 for s in sizes]


def test_the_compiled_stack_distances_equal_the_python_ones() -> None:
    """In a child process with numba allowed (this one keeps it out, see tests/conftest.py)."""
    code = (
        "import numpy as np, random\n"
        "from kvtier.trace import mrc\n"
        "assert mrc._compiled() is not None, 'numba is not importable'\n"
        "rng = random.Random(7)\n"
        "ids = np.array([rng.randrange(40) for _ in range(3000)], dtype=np.uint64)\n"
        "prev = mrc.previous_reference(ids)\n"
        "assert np.array_equal(mrc.stack_distances(prev), mrc.stack_distances(prev, compiled=False))\n"
    )
    if importlib.util.find_spec("numba") is None:  # not imported here: see above
        pytest.skip("numba is not installed")
    env = {**os.environ, "KVTIER_NUMBA": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_arc_sampled_simulation_stays_close_to_exact() -> None:
    rng = np.random.default_rng(0)
    popularity = 1 / np.arange(1, 5001) ** 0.8
    ranks = rng.choice(5000, 40_000, p=popularity / popularity.sum()).astype(np.uint64)
    refs = ranks * np.uint64(0x9E3779B97F4A7C15)  # spread over the hash space, as real keys are
    exact = simulate(ARCPolicy, refs, [500, 2000])
    sampled = simulate(ARCPolicy, refs, [500, 2000], rate=0.5)
    assert all(abs(a - b) < 0.04 for a, b in zip(exact, sampled, strict=True))
    # ARC beats LRU on this skewed stream, and never beats an unbounded cache.
    lru = lru_hit_ratios(stack_distances(previous_reference(refs)), [500, 2000])
    assert lru[0] < exact[0] < exact[1] <= float((previous_reference(refs) >= 0).mean())


def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", KNOWN)
    out = tmp_path / "plan"
    assert main(["plan", str(path), "--json", "--out", str(out), "--host-gib-s", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "plan.json").read_text())
    assert printed["host_gib_s"] == 1.0
    for png in ("mrc.png", "reuse_time_cdf.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", str(path), "--host-gib-s", "1"]) == 0
    assert "reusable prompt tokens 35.7%" in capsys.readouterr().out


def test_bytes_per_token_for_traces_without_chunk_bytes(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", KNOWN, chunk_bytes=None, source="kv_events")
    with pytest.raises(TraceError, match="--bytes-per-token"):
        plan(read_traces([path]), host_bytes_per_s=1e9)
    assert main(["plan", str(path), "--bytes-per-token", "10", "--host-gib-s", "1"]) == 0


def test_bad_input_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write_trace(tmp_path / "good.jsonl", KNOWN)
    text = good.read_text()
    truncated = tmp_path / "truncated.jsonl"
    truncated.write_text(text[:-20])
    with pytest.raises(TraceError, match=f"{truncated}:5: truncated"):
        read_traces([truncated])
    corrupt = tmp_path / "corrupt.jsonl"
    lines = text.splitlines(keepends=True)
    corrupt.write_text("".join([*lines[:2], '{"t": 1, "keys": "abc"}\n', *lines[3:]]))
    with pytest.raises(TraceError, match=f"{corrupt}:3: not a trace record"):
        read_traces([corrupt])
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match=f"{foreign}:1: not a kvtier trace"):
        read_traces([foreign])
    empty = tmp_path / "empty.jsonl"
    empty.write_text(lines[0])
    with pytest.raises(TraceError, match="empty trace"):
        read_traces([empty])
    with pytest.raises(TraceError, match="cannot read"):
        read_traces([tmp_path / "missing.jsonl"])
    assert main(["plan", str(foreign)]) == 2
    assert f"{foreign}:1: not a kvtier trace" in capsys.readouterr().err


def test_observed_and_predicted_host_hit_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "t.jsonl", KNOWN)
    assert main(["plan", str(path), "--json", "--host-gib-s", "1", "--at", "4000,6e3"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 14 chunk references of 16 tokens: 224 tokens; the device served 32, the host 48.
    assert report["observed_hit_ratio"] == pytest.approx(
        {"device": 32 / 224, "host": 48 / 224, "recomputed": 144 / 224})
    four, six = report["predict"]
    assert (four["bytes"], six["bytes"]) == (4000, 6000)
    assert (four["lru_hit_ratio"], six["lru_hit_ratio"]) == pytest.approx((4 / 14, 5 / 14))
    # Behind the device: at t=10 A, B come from the device (not refreshed in the host) and the
    # host stores E, F; with 4 slots that evicts C, D (A and B are named by that store, as the
    # engine's store names every chunk its step completed), so t=30 finds A, B; with 6 the host
    # serves A, B, C.
    assert (four["host_hit_ratio"], six["host_hit_ratio"]) == pytest.approx((2 / 14, 3 / 14))


def test_replay_of_the_host_tier_behind_the_device(tmp_path: Path) -> None:
    records = [  # 16-token chunks; ttft puts each request's stores after its prefill
        {"t": 0.0, "ttft": 1.0, "keys": [A, B], "prompt": 33, "src": {"device": 0}},
        {"t": 0.5, "ttft": 1.0, "keys": [A, B, C], "prompt": 49, "src": {"device": 0}},  # before A, B stored
        {"t": 2.0, "ttft": 1.0, "keys": [A, B, C], "prompt": 49, "src": {"device": 32}},  # A, B from device
        {"t": 3.0, "ttft": 1.0, "keys": [D, E, F], "prompt": 49, "src": {"device": 0}},
        {"t": 5.0, "ttft": 1.0, "keys": [A], "prompt": 17, "src": {"device": 0}},
    ]
    trace = read_traces([write_trace(tmp_path / "t.jsonl", records)])
    # C hits at t=2; at t=5, A is still there with 6 slots, evicted by D, E, F with 3.
    assert host_hit_ratios(trace, [0, 3, 6]) == [0.0, 1 / 12, 2 / 12]
    report = plan(trace, host_bytes_per_s=1e9, at=[3000, 6000]).report
    assert [p["host_hit_ratio"] for p in report["predict"]] == [1 / 12, 2 / 12]


def test_replay_stores_the_chunks_decode_filled(tmp_path: Path) -> None:
    records = [
        {"t": 0.0, "ttft": 1.0, "keys": [A], "dkeys": [B], "prompt": 20, "src": {"device": 0}},
        {"t": 2.0, "ttft": 1.0, "keys": [A, B], "prompt": 40, "src": {"device": 0}},
        {"t": 4.0, "ttft": 1.0, "keys": [C], "dkeys": [D, E], "prompt": 20, "src": {"device": 0}},
        {"t": 6.0, "ttft": 1.0, "keys": [A], "prompt": 20, "src": {"device": 0}},
    ]
    trace = read_traces([write_trace(tmp_path / "t.jsonl", records)])
    assert list(trace.decode_counts) == [1, 0, 2, 0] and list(trace.decode_refs) == [B, D, E]
    # B, stored by the first request's decode, serves the second; C, D and E (never asked for) push
    # A out of a 3-chunk host before the last request. A 4-chunk one gives up B instead: the
    # second request's end made A, the head of its prefix, the most recent.
    assert host_hit_ratios(trace, [3, 4]) == [2 / 5, 3 / 5]


def test_replay_follows_the_recorded_steps_and_pins_loads(tmp_path: Path) -> None:
    records = [  # `st`: [seconds after arrival, chunks complete after that step]
        {"t": 0.0, "ttft": 5.0, "st": [[1.0, 2]], "keys": [A, B], "prompt": 33, "src": {"device": 0}},
        {"t": 2.0, "ttft": 2.0, "lookup": 0.0, "st": [[1.0, 3]], "keys": [A, B, C], "prompt": 49,
         "src": {"device": 0}},
        {"t": 2.5, "ttft": 0.5, "st": [[0.0, 1]], "keys": [D], "prompt": 17, "src": {"device": 0}},
        {"t": 2.8, "ttft": 0.5, "st": [[0.5, 1]], "keys": [D], "prompt": 17, "src": {"device": 0}},
    ]
    trace = read_traces([write_trace(tmp_path / "t.jsonl", records)])
    assert trace.stores == [[(1.0, 2)], [(1.0, 3)], [(0.0, 1)], [(0.5, 1)]]
    # A, B are stored at t=1 (their step), not at the first token (t=5): the request at t=2 finds
    # them, and they stay pinned for its load until its next step (t=3). With 2 slots the store of
    # D at t=2.5 finds no row (both pinned), so t=2.8 misses D; with 3 it finds D.
    assert host_hit_ratios(trace, [2, 3]) == [2 / 7, 3 / 7]
