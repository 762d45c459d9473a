"""`kvtier trace record`: a real vLLM engine without kvtier publishes its KV events on a loopback
ZMQ endpoint; the recorder (the command's loop, on a thread) writes the trace `kvtier plan` reads."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.integrations.vllm.serving.trace_record import Recorder, record
from kvtier.trace.records import read_traces
from tests.integrations.conftest import BLOCK_SIZE, DEVICE_BLOCKS, _model_path
from tests.integrations.prompts import PROMPTS

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2 float32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_record_kv_events_of_an_engine_without_kvtier(vllm_env: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "events.jsonl"
    stop, ready = threading.Event(), threading.Event()
    recorded: list[Recorder] = []
    recorder = threading.Thread(target=lambda: recorded.append(record(
        endpoint, out, bind=True, bytes_per_token=BYTES_PER_TOKEN, stop=stop, ready=ready)))
    recorder.start()
    try:
        assert ready.wait(30)
        llm = LLM(model=str(_model_path()), dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=DEVICE_BLOCKS, kv_cache_memory_bytes=64 << 20,
                  max_model_len=1024, max_num_seqs=4, seed=0,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                  endpoint=endpoint))
        ids: list[int] = llm.get_tokenizer().encode(PROMPTS["lighthouse"])
        a = ids[: (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE + 1]
        b = a[: 2 * BLOCK_SIZE] + llm.get_tokenizer().encode(PROMPTS["bread"])[: 2 * BLOCK_SIZE + 5]
        params = SamplingParams(temperature=0.0, max_tokens=3)
        llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)
        llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)  # 2 blocks from the device
        assert llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)  # a computed again
        llm.llm_engine.engine_core.shutdown()  # flushes the publisher
    finally:
        stop.set()
        recorder.join(60)
    assert (recorded[0].missed, recorded[0].undecodable) == (0, 0)
    assert recorded[0].events >= 3

    trace = read_traces([out])
    full = (len(a) - 1) // BLOCK_SIZE
    assert (trace.header.source, trace.header.block_size) == ("kv_events", BLOCK_SIZE)
    assert trace.header.chunk_bytes == BYTES_PER_TOKEN * BLOCK_SIZE
    assert list(trace.counts) == [full, 2, full]  # b stores only the blocks it computed
    first = trace.refs[: trace.counts[0]]
    again = trace.refs[trace.starts[2] : trace.starts[2] + trace.counts[2]]
    assert list(first) == list(again) and len(set(trace.refs)) == full + 2

    capsys.readouterr()  # the engine's log lines
    assert main(["plan", str(out), "--json", "--host-gib-s", "1"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert report["source"] == "kv_events"
    assert report["reusable_token_fraction"] == pytest.approx(full / (2 * full + 2))
    assert report["never_reused_chunk_fraction"] == pytest.approx(2 / (full + 2))


def test_the_command_counts_lost_and_foreign_messages(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "t.jsonl"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # an XPUB receives each subscription: the recorder's says it is in
    pub.bind(endpoint)
    stored = BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[], block_size=16,
                         lora_id=None, medium="GPU", lora_name=None)
    batch = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[stored]))

    subscribed: list[bytes] = []

    def publish() -> None:
        if pub.poll(30_000):
            subscribed.append(pub.recv())
        for seq, payload in ((0, b"not msgpack"), (1, batch), (5, batch)):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    sender = threading.Thread(target=publish)
    sender.start()
    # It stops after the second event; the duration only bounds a run that would never get it.
    assert main(["trace", "record", "--zmq", endpoint, "--out", str(out), "--max-events", "2",
                 "--duration", "60"]) == 0
    sender.join()
    assert subscribed == [b"\x01"], "the recorder never subscribed"
    pub.close(linger=0)
    ctx.term()
    err = capsys.readouterr().err
    assert "recorded 2 events" in err and "3 batches missed, 1 undecodable" in err
    trace = read_traces([out])
    assert list(trace.refs) == [7, 8, 7, 8] and trace.header.chunk_bytes is None
