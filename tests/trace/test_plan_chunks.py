"""The plan's chunk-size table with unfull chunks: hand-built traces whose answer is known, and
random traces against a request-by-request model of the engine's rule (`kvtier.engine.unfull`)."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.trace.plan import plan
from kvtier.trace.records import read_traces
from tests.trace.traces import write_trace

BLOCK = 16


def block_key(tokens: Sequence[int]) -> int:
    """The key of the block that ends `tokens` (it names the whole prefix, as chained keys do)."""
    return int.from_bytes(hashlib.blake2b(repr(list(tokens)).encode(), digest_size=8).digest(), "big")


def request(t: float, end: float, prompt: list[int], output: list[int], block: int = BLOCK) -> dict:
    """A connector trace record: the prompt's block keys, then those its reply filled up to the
    tokens the engine computed (prompt and reply but its last token)."""
    sequence = prompt + output
    computed = len(sequence) - 1
    keys = [block_key(sequence[: block * (i + 1)]) for i in range(computed // block)]
    whole = len(prompt) // block
    return {"t": t, "end": end, "prompt": len(prompt), "output": len(output), "prio": 0,
            "keys": keys[:whole], "dkeys": keys[whole:]}


def rows_of(path: Path) -> dict[int, dict]:
    report = plan(read_traces([path]), host_bytes_per_s=1e15).report
    return {r["blocks_per_chunk"]: r for r in report["chunk_size"]}


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_a_second_turn_reloads_the_unfull_chunk_its_first_turn_ended_with(tmp_path: Path) -> None:
    # Turn 1: 100 prompt tokens and 14 of reply; the engine computed 113 tokens, 7 whole blocks
    # (6 of the prompt, 1 of the reply). Turn 2, sent once turn 1 finished, goes on from all 114.
    first, reply = tokens(100), tokens(14, 1000)
    second = first + reply + tokens(40, 2000)
    path = write_trace(tmp_path / "t.jsonl", [request(0.0, 5.0, first, reply),
                                              request(10.0, 15.0, second, tokens(5, 3000))])
    rows = rows_of(path)
    # Every size reloads the 7 blocks: whole chunks, then the unfull chunk turn 1 stored.
    assert {b: r["reused_tokens"] for b, r in rows.items()} == {b: 112 for b in (1, 2, 4, 8, 16, 32)}
    assert {b: r["unfull_tokens"] for b, r in rows.items()} == {1: 0, 2: 16, 4: 48, 8: 112, 16: 112, 32: 112}
    report = plan(read_traces([path]), host_bytes_per_s=1e15).report
    assert (report["recommend"]["chunk_tokens"], report["recommend"]["blocks_per_chunk"]) == (512, 32)


def test_a_request_sent_before_the_earlier_one_finished_finds_no_unfull_chunk(tmp_path: Path) -> None:
    # A (112 prompt tokens, 7 blocks, one reply token) finishes at 5: its 3 blocks past the
    # 64-token chunk are stored then. B, sent at 2, misses them; C, sent at 10, loads them.
    document = tokens(112)
    path = write_trace(tmp_path / "t.jsonl", [
        request(0.0, 5.0, document, [7]),
        request(2.0, 8.0, document + tokens(40, 1000), [8]),
        request(10.0, 12.0, document + tokens(40, 2000), [9]),
    ])
    four = rows_of(path)[4]
    assert (four["reused_tokens"], four["unfull_tokens"]) == (64 + 112, 48)


def test_only_an_end_with_the_same_tokens_matches(tmp_path: Path) -> None:
    # A ends at 7 blocks, A2 (A's first 96 tokens) at 6. B shares A's tokens but the last of its
    # 7th block: A's unfull chunk of 3 blocks is not B's; A2's, of 2 blocks, is.
    document = tokens(112)
    other = [*document[:111], 5000]
    path = write_trace(tmp_path / "t.jsonl", [
        request(0.0, 1.0, document, [7]),
        request(2.0, 3.0, document[:96], [8]),
        request(10.0, 12.0, other + tokens(30, 1000), [9]),
    ])
    four = rows_of(path)[4]
    # A2: one whole chunk (64 tokens) of A's. B: one whole chunk and A2's 2 blocks.
    assert (four["reused_tokens"], four["unfull_tokens"]) == (64 + 96, 32)


def test_a_lookup_never_offers_the_last_prompt_token(tmp_path: Path) -> None:
    # The same 128-token prompt twice: the second may load 127 tokens, so 7 blocks of one-block
    # chunks and one 64-token chunk (the second holds the last token; A stored it whole).
    document = tokens(128)
    path = write_trace(tmp_path / "t.jsonl", [request(0.0, 1.0, document, [1]),
                                              request(5.0, 6.0, document, [2])])
    rows = rows_of(path)
    assert (rows[1]["reused_tokens"], rows[4]["reused_tokens"], rows[4]["unfull_tokens"]) == (112, 64, 0)


def test_the_cli_prints_the_recommended_chunk_tokens(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    first, reply = tokens(100), tokens(14, 1000)
    path = write_trace(tmp_path / "t.jsonl", [request(0.0, 5.0, first, reply),
                                              request(10.0, 15.0, first + reply + tokens(40, 2000), [1])])
    assert main(["plan", str(path), "--json", "--host-gib-s", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["recommend"]["chunk_tokens"] == 512
    assert main(["plan", str(path), "--host-gib-s", "1000"]) == 0
    assert "chunk_tokens 512 (blocks_per_chunk 32)" in capsys.readouterr().out


# -- the randomized check against a plain model of the engine ------------------------------------

SMALL = 4  # tokens per block: short sequences span many chunk sizes


def reference(records: list[tuple[float, float, list[int], list[int]]], f: int) -> tuple[int, int]:
    """Reused and unfull tokens at chunks of `f` blocks, request by request in arrival order, as
    the engine would: full chunks any earlier request stored (prompt and reply), then the largest
    unfull chunk an earlier request stored when it finished, keyed by its exact tokens."""
    chunk = f * SMALL
    full: set[tuple[int, ...]] = set()
    unfull: dict[tuple[int, ...], float] = {}
    reused = unfull_tokens = 0
    for t, end, prompt, output in records:
        count = 0
        while count < (len(prompt) - 1) // chunk and tuple(prompt[: (count + 1) * chunk]) in full:
            count += 1
        base = count * chunk
        found = 0
        for b in range(min(f - 1, (len(prompt) - 1 - base) // SMALL), 0, -1):
            finished = unfull.get(tuple(prompt[: base + b * SMALL]))
            if finished is not None and finished < t:
                found = b
                break
        reused += base + found * SMALL
        unfull_tokens += found * SMALL
        sequence = prompt + output
        computed = len(sequence) - 1
        for i in range(computed // chunk):
            full.add(tuple(sequence[: (i + 1) * chunk]))
        blocks = computed // SMALL
        if blocks % f:
            key = tuple(sequence[: blocks * SMALL])
            unfull[key] = min(unfull.get(key, end), end)
    return reused, unfull_tokens


def random_records(rng: random.Random) -> list[tuple[float, float, list[int], list[int]]]:
    """Conversations that go on from an earlier turn (all of it, or a cut), fresh prompts, and
    overlapping requests; tokens from a small alphabet so that unrelated prompts meet too."""
    records: list[tuple[float, float, list[int], list[int]]] = []
    t = 0.0
    for _ in range(rng.randrange(5, 40)):
        t += rng.choice([0.5, 1.0, 3.0])
        fresh = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        if records and rng.random() < 0.7:
            _, _, prompt, output = rng.choice(records)
            earlier = prompt + output
            cut = len(earlier) if rng.random() < 0.5 else rng.randrange(len(earlier) + 1)
            prompt = earlier[:cut] + fresh
        else:
            prompt = fresh
        output = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        records.append((t, t + rng.choice([0.2, 1.0, 4.0]), prompt, output))
    return records


@pytest.mark.parametrize("seed", range(30))
def test_the_table_equals_a_request_by_request_model(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    records = random_records(rng)
    path = write_trace(tmp_path / "t.jsonl",
                       [request(t, end, p, o, SMALL) for t, end, p, o in records], block_size=SMALL)
    rows = rows_of(path)
    assert sorted(rows) == [1, 2, 4, 8, 16, 32]
    for f, row in rows.items():
        assert (row["reused_tokens"], row["unfull_tokens"]) == reference(records, f), f
