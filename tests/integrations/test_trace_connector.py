"""`trace_path`: a real in-process vLLM engine with kvtier writes one record per finished request
(keys, sources, times), and `kvtier plan` reads the trace."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.trace.records import KEY_BYTES, read_traces
from tests.integrations.conftest import BLOCK_SIZE, connector_halves
from tests.integrations.prompts import PROMPTS

pytestmark = pytest.mark.slow

ROW_BYTES = 30 * 2 * 3 * BLOCK_SIZE * 64 * 4  # SmolLM2 float32, one block per chunk


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "requests.jsonl"


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any], trace_path: Path) -> Any:
    return make_llm({"cpu_bytes_to_use": 16 * ROW_BYTES, "trace_path": str(trace_path)},
                    dtype="float32")


def generate(llm: Any, prompt: list[int], salt: str | None = None) -> Any:
    from vllm import SamplingParams

    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt:
        request["cache_salt"] = salt
    return llm.generate([request], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]


def records(path: Path, count: int) -> list[dict[str, Any]]:
    """The trace's request records once `count` are written (the writer is asynchronous)."""
    deadline = time.monotonic() + 10
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > count or time.monotonic() > deadline:
            return [json.loads(line) for line in lines[1:]]
        time.sleep(0.05)


def test_trace_of_a_run_and_its_plan(llm: Any, trace_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids: list[int] = llm.get_tokenizer().encode(PROMPTS["lighthouse"])
    a = ids[: (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE + 1]
    b = a[: 2 * BLOCK_SIZE] + llm.get_tokenizer().encode(PROMPTS["bread"])[: BLOCK_SIZE + 5]
    scheduler, _ = connector_halves(llm)
    keys = scheduler.hasher.keys(a)
    start = time.time()
    outputs = [generate(llm, a), generate(llm, b)]
    assert llm.reset_prefix_cache()
    outputs += [generate(llm, a), generate(llm, a, salt="tenant-1")]
    recs = records(trace_path, 4)
    assert len(recs) == 4
    for rec, out in zip(recs, outputs, strict=True):
        prompt = len(out.prompt_token_ids)
        assert (rec["prompt"], rec["output"]) == (prompt, 3)
        assert len(rec["keys"]) == prompt // BLOCK_SIZE * KEY_BYTES * 2
        assert rec["src"] == out.kv_transfer_params["kvtier"]["tokens"]
        assert sum(rec["src"].values()) == prompt
        assert start <= rec["t"] < rec["t"] + rec["ttft"] <= rec["end"] <= time.time()
        assert rec["wait"] == 0.0 and rec["prio"] == DEFAULT_PRIORITY
        assert 0 <= rec["lookup"] <= rec["ttft"]  # the lookup it was allocated on, after arrival
        assert len(rec["dkeys"]) == ((prompt + 2) // BLOCK_SIZE - prompt // BLOCK_SIZE) * KEY_BYTES * 2
        # the steps that completed its chunks: in order, after its lookup, ending with every chunk
        steps = rec["st"]
        assert [n for _, n in steps] == sorted({n for _, n in steps})
        assert steps[-1][1] == (prompt + 2) // BLOCK_SIZE
        assert rec["lookup"] <= steps[0][0] <= rec["ttft"] and steps[-1][0] <= rec["end"] - rec["t"]
        assert "token" not in json.dumps(rec)  # keys only: no token ids, no text
    full = (len(a) - 1) // BLOCK_SIZE
    assert recs[0]["keys"] == b"".join(k[:KEY_BYTES] for k in keys).hex()
    assert recs[0]["src"]["recomputed"] == len(a)
    assert recs[1]["src"]["device"] == 2 * BLOCK_SIZE
    assert recs[1]["keys"][: 2 * KEY_BYTES * 2] == recs[0]["keys"][: 2 * KEY_BYTES * 2]
    assert recs[2]["src"]["host"] == full * BLOCK_SIZE and recs[2]["keys"] == recs[0]["keys"]
    assert recs[0]["salt"] is None
    assert len(recs[3]["salt"]) == 16  # a tag keyed per trace: no unkeyed hash of the salt
    assert recs[3]["salt"] not in (hashlib.sha256(b"tenant-1").hexdigest()[:16],
                                   hashlib.blake2b(b"tenant-1", digest_size=8).hexdigest())
    assert recs[3]["keys"][:16] != recs[0]["keys"][:16]  # the salt is in every key

    trace = read_traces([trace_path])
    assert (trace.header.chunk_bytes, trace.header.block_size) == (ROW_BYTES, BLOCK_SIZE)
    capsys.readouterr()  # the engine's log lines
    assert main(["plan", str(trace_path), "--json", "--host-gib-s", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 4
    reused = (2 + full) * BLOCK_SIZE  # b reuses 2 chunks of a, the third request all of a's
    assert report["reusable_token_fraction"] == pytest.approx(reused / report["prompt_tokens"])
    assert report["token_sources"]["host"] == full * BLOCK_SIZE
