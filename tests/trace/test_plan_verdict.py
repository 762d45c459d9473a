"""`kvtier plan`'s verdict on one known-answer trace per verdict and reason, the context-length
percentiles, and the host tier's probation as the plan models it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.policies.load_rule import load_pays
from kvtier.trace.analysis import Stream
from kvtier.trace.mrc import lru_hit_ratios, previous_reference, stack_distances
from kvtier.trace.plan import plan
from kvtier.trace.probation import host_runs
from kvtier.trace.records import Trace, read_traces
from kvtier.trace.verdict import BEYOND, NO_HELP, OFFLOAD, TRANSFER, UNIQUE, WITH_ADMISSION
from tests.trace.traces import write_trace

# 16-token chunks of 1000 bytes. Two conversations; the engine recomputed 96 tokens in 0.096 s of
# TTFT on the requests that loaded nothing (the host load at t=3 is left out): 1000 tokens/s.
CHATS = [
    {"t": 0.0, "keys": [1, 2], "prompt": 32, "src": {"recomputed": 32}, "ttft": 0.032},
    {"t": 1.0, "keys": [1, 2, 3], "prompt": 48, "src": {"device": 32, "recomputed": 16}, "ttft": 0.016},
    {"t": 2.0, "keys": [4, 5], "prompt": 32, "src": {"recomputed": 32}, "ttft": 0.032},
    {"t": 3.0, "keys": [1, 2, 3, 6], "prompt": 64, "src": {"host": 48, "recomputed": 16}, "ttft": 0.01},
    {"t": 4.0, "keys": [4, 5, 7], "prompt": 48, "src": {"device": 32, "recomputed": 16}, "ttft": 0.016},
]


def _trace(tmp_path: Path, records: list[dict]) -> Trace:
    return read_traces([write_trace(tmp_path / "t.jsonl", records)])


def _plan(tmp_path: Path, records: list[dict], host_bytes_per_s: float = 1e6,
          host_bytes: int | None = None, prefill_tok_s: float | None = None) -> dict:
    return plan(_trace(tmp_path, records), host_bytes_per_s=host_bytes_per_s, host_bytes=host_bytes,
                prefill_tok_s=prefill_tok_s).report


def test_offload_and_the_context_lengths(tmp_path: Path) -> None:
    report = _plan(tmp_path, CHATS)
    assert report["verdict"] == OFFLOAD
    # Reuse distances 2, 2, 5, 5, 5, 6, 6: 6 chunks hold all 7 reuses of the 14 references.
    assert report["verdict_reason"] == (
        "a host tier of 5.86 KiB serves 50.0% of the chunk references (100% of the reachable "
        "reuse); a load takes 1 ms per chunk, a recompute 16 ms")
    checks = report["verdict_checks"]
    assert checks["prefill_tokens_per_s"] == pytest.approx(1000.0)
    assert (checks["load_ms_per_chunk"], checks["recompute_ms_per_chunk"]) == pytest.approx((1.0, 16.0))
    assert (checks["host_bytes"], checks["reuse_served_fraction"]) == (6000, 1.0)
    assert checks["admission_gain"] == 0.0
    # Prompts 32, 32, 48, 48, 64 tokens: linear interpolation between the sorted values.
    assert report["context_length_tokens"] == pytest.approx({"p50": 48.0, "p95": 60.8, "p99": 63.36})


def test_transfer_above_recompute_will_not_help(tmp_path: Path) -> None:
    report = _plan(tmp_path, CHATS, host_bytes_per_s=1e4)
    assert report["verdict"] == NO_HELP
    assert report["verdict_reason"] == (
        f"{TRANSFER}: loading a chunk of 1000 bytes takes 100 ms at 9.31e-06 GiB/s, recomputing "
        "its 16 tokens 16 ms at 1000 tokens/s (a load pays under 90% of it)")
    # The engine's rate, when given, replaces the trace's.
    assert _plan(tmp_path, CHATS, host_bytes_per_s=1e4, prefill_tok_s=100.0)["verdict"] == OFFLOAD


@pytest.mark.parametrize(("load_ms", "helps"), [(14.0, True), (15.0, False), (17.0, False)])
def test_the_verdict_applies_the_engines_load_rule(tmp_path: Path, load_ms: float, helps: bool) -> None:
    """A chunk of 1000 bytes against a 16 ms recompute: a load of 14 ms pays, one of 15 ms is
    within the margin that makes `load_policy: auto` recompute, so the plan says it will not help;
    the same rule decides in the engine (`tests/engine/test_load_choice.py`)."""
    report = _plan(tmp_path, CHATS, host_bytes_per_s=1000 / (load_ms / 1000))
    assert (report["verdict"] != NO_HELP) is helps
    assert (report["verdict"] != NO_HELP) is load_pays(load_ms / 1000, 16 / 1000)


def test_mostly_unique_prompts_will_not_help(tmp_path: Path) -> None:
    # Ten prompts of four chunks; only the second one's first chunk repeats (1 of 40 references).
    records = [{"t": float(r), "keys": [100 * r + c for c in range(4)], "prompt": 64, "src": {}}
               for r in range(10)]
    records[1]["keys"] = [0, 101, 102, 103]
    report = _plan(tmp_path, records)
    assert report["verdict"] == NO_HELP
    assert report["verdict_reason"] == (
        f"{UNIQUE}: 2.5% of the prompt tokens repeat an earlier prefix, under 10%")
    assert report["context_length_tokens"] == {"p50": 64.0, "p95": 64.0, "p99": 64.0}


def test_reuse_beyond_the_recommended_size_will_not_help(tmp_path: Path) -> None:
    # Twenty one-chunk prompts, then the same twenty again in order: every reuse comes 20 s (and
    # 20 distinct chunks) after the chunk's previous use; a host of 5 chunks keeps one for 5 s.
    records = [{"t": float(t), "keys": [t % 20], "prompt": 16, "src": {}} for t in range(40)]
    report = _plan(tmp_path, records, host_bytes=5000)
    assert report["recommend"]["cpu_bytes_to_use"] == 5000
    assert report["verdict"] == NO_HELP
    assert report["verdict_reason"] == (
        f"{BEYOND}: a host tier of 4.88 KiB serves 0% of the reachable reuse, under 50%; reuses "
        "come 20 s (p50) after the chunk's previous use, it keeps an unused chunk 5 s")
    # Uncapped, the plan sizes the host for all 20 chunks and the verdict is to offload.
    uncapped = _plan(tmp_path, records)
    assert (uncapped["recommend"]["cpu_bytes_to_use"], uncapped["verdict"]) == (20000, OFFLOAD)


# A hot two-chunk prefix between one-off prompts of four chunks, t = 0..6.
HOT_AND_ONE_OFF = [
    {"t": float(t), "keys": [1, 2] if t % 2 == 0 else [10 * t + c for c in range(4)],
     "prompt": 32 if t % 2 == 0 else 64, "src": {}}
    for t in range(7)
]


def test_offload_with_admission(tmp_path: Path) -> None:
    report = _plan(tmp_path, HOT_AND_ONE_OFF, host_bytes=4000)
    # LRU with 4 chunks: each one-off prompt pushes the prefix out. Probation (min_seen 2): the
    # prefix is stored settled at its second sighting and the one-offs evict each other, so its
    # third and fourth requests hit (4 of 20 references); min_seen 3 settles it one request later.
    rows = report["admission"]["frequency"]
    assert [r["host_hit_ratio"] for r in rows] == pytest.approx([0.0, 0.2, 0.1, 0.0])
    assert rows[1]["probation_chunk_fraction"] == pytest.approx(14 / 16)
    assert report["verdict"] == WITH_ADMISSION
    assert report["verdict_reason"] == (
        "a host tier of 3.91 KiB with frequency admission (admission_min_seen 2) serves 20.0% of "
        "the chunk references, 0.0% admitting all: one-off prompts wait on probation and leave first")
    assert report["verdict_checks"]["admission_gain"] == pytest.approx(0.2)
    assert report["recommend"]["admission"]["frequency_min_seen"] == 2


def test_probation_evicts_cold_then_warm_then_settled(tmp_path: Path) -> None:
    records = [{"t": float(t), "keys": keys, "prompt": 16 * len(keys), "src": {}}
               for t, keys in enumerate([[1], [1, 2], [5], [7], [1, 2], [8]])]
    lru, freq = host_runs(Stream.of(_trace(tmp_path, records)), 3, [1, 2])
    # min_seen 2: at t=1 chunk 1 settles and 2 continues it (warm); 5 (t=2) is cold, so 7 (t=3)
    # evicts 5, not the older 2 nor 1; at t=4 both hit, and 8 evicts the cold 7. LRU evicts 1 at
    # t=3 and then misses both.
    assert (freq.hits, freq.stored, freq.on_probation) == (3, 5, 5)
    assert freq.holding_s == pytest.approx(1.5)  # 5 evicted 1 s after its use, 7 after 2 s
    assert (lru.hits, lru.on_probation) == (1, 0)


@pytest.mark.parametrize("seed", range(3))
def test_probation_with_min_seen_one_is_the_lru_curve(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    records = [{"t": float(t), "keys": [rng.randrange(30) for _ in range(rng.randrange(1, 5))],
                "prompt": 16, "src": {}} for t in range(150)]
    trace = _trace(tmp_path, records)
    distances = stack_distances(previous_reference(trace.refs))
    for size in (0, 3, 10, 25):
        (run,) = host_runs(Stream.of(trace), size, [1])
        (lru,) = lru_hit_ratios(distances, [size])
        assert run.hits == round(lru * len(trace.refs))


def test_cli_prints_the_verdict_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [{"t": float(t), "keys": [t % 20], "prompt": 16, "src": {}} for t in range(40)]
    path = write_trace(tmp_path / "t.jsonl", records)
    assert main(["plan", str(path), "--json", "--host-gib-s", "1", "--host-bytes", "5e3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["verdict"], report["host_bytes_limit"]) == (NO_HELP, 5000)
    assert report["context_length_tokens"] == {"p50": 16.0, "p95": 16.0, "p99": 16.0}
    assert main(["plan", str(path), "--host-gib-s", "1", "--prefill-tok-s", "1e12"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith(f"verdict: {NO_HELP}: {TRANSFER}: loading a chunk of 1000 bytes")
    assert second.startswith("requests 40, prompt tokens 640 (per request p50/p95/p99 16/16/16)")
