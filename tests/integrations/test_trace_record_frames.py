"""`kvtier trace record --bind` against a hostile publisher on a real ZMQ socket: messages of other
than vLLM's three frames are counted and dropped, an oversized one drops its sender's connection
before it is buffered, and the recording goes on to take the next valid batch."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from kvtier.integrations.vllm.serving.trace_record import Recorder, record
from kvtier.trace.records import read_traces
from tests.integrations.conftest import require_vllm

LIMIT = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_bad_frames_are_counted_and_an_oversized_message_is_cut_off(tmp_path: Path) -> None:
    require_vllm()
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    endpoint, out = f"tcp://127.0.0.1:{free_port()}", tmp_path / "t.jsonl"
    stored = BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[], block_size=16,
                         lora_id=None, medium="GPU", lora_name=None)
    batch = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[stored]))
    ready, recorded, errors = threading.Event(), list[Recorder](), list[BaseException]()

    def run() -> None:
        try:
            recorded.append(record(endpoint, out, bind=True, max_events=1, duration_s=60,
                                   max_message_bytes=LIMIT, ready=ready))
        except BaseException as e:
            errors.append(e)

    recorder = threading.Thread(target=run)
    recorder.start()
    assert ready.wait(30)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # an XPUB receives each subscription: the recorder's says it is in
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every one, so a reconnection shows too
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)
    try:
        assert pub.poll(30_000), "the recorder never subscribed"
        pub.recv()
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"x" * (LIMIT + 1)])
        assert pub.poll(30_000), "the oversized message did not drop the connection"
        pub.recv()
        for frames in ([b"one frame"], [b"", (2).to_bytes(8, "big"), batch, b"fourth"],
                       [b"", b"\x03", batch], [b"", (3).to_bytes(8, "big"), batch]):
            pub.send_multipart(frames)
        recorder.join(60)
    finally:
        pub.close()
        ctx.term()
    assert not errors, f"the recorder raised {errors!r}"
    [rec] = recorded
    assert (rec.events, rec.malformed, rec.undecodable) == (1, 3, 0)
    assert list(read_traces([out]).refs) == [7, 8]
